"""Training runs that never lose or mix results (storyrl.training.runs and
the trainers that use it): exact resume for every algorithm x policy kind x
full/LoRA, one run per output directory (refused without --overwrite,
locked), resume past an incomplete checkpoint, runs that train nothing fail,
checkpoints that need no unpickling, strict RL configs, multi-process PPO.

Tiny random-weight policies built here (tests/tiny_models.py); nothing is
downloaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_rl_train import (  # noqa: F401  (assets: a fixture)
    REPO,
    assets,
    options,
    read_jsonl,
    train_two_processes,
    write_yaml,
)

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)
from storyrl.rewards import Reward, register_reward

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


# A reward that interrupts the run (as a kill would) at its CRASH_AT-th call.
CRASH = {"at": None, "calls": 0}


@register_reward()
class _CrashingWords(Reward):
    """Test reward: a tenth of the word count; raises KeyboardInterrupt at
    call CRASH['at'] (counted over the process)."""

    name = "test_safety_words"

    def _score_batch(self, stories, **context):
        CRASH["calls"] += 1
        if CRASH["at"] is not None and CRASH["calls"] == CRASH["at"]:
            raise KeyboardInterrupt
        return np.array([len(s.split()) / 10 for s in stories])


@register_reward()
class _Nothing(Reward):
    """Test reward: every story unscorable."""

    name = "test_safety_nothing"

    def _score_batch(self, stories, **context):
        return np.full(len(stories), np.nan)


def crashing_run(crash_at):
    CRASH.update(at=crash_at, calls=0)


def final_tensors(directory):
    from safetensors.numpy import load_file

    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        out.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    assert out, f"no weights in {directory}"
    return out


@pytest.fixture(scope="module")
def tapm_dirs(tmp_path_factory):
    """TAPM policy directories (full and LoRA), their features and records."""
    import tiny_models
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureExtractor, FeatureStore, write_features
    from storyrl.generators.tapm.model import TapmModel

    root = tmp_path_factory.mktemp("tapm_safety")
    images = tiny_models.write_images(root / "img", n=4)
    write_features(root / "features", [(p.stem, str(p)) for p in images],
                   FeatureExtractor("test_resnet", pretrained=False, device="cpu"), batch_size=4)
    decoder = tiny_models.save_tiny_decoder(root / "gpt2")
    tokenizer, store = AutoTokenizer.from_pretrained(decoder), FeatureStore(root / "features")
    dims = {t: s["dim"] for t, s in store.types.items()}
    tokens = {t: s["tokens"] for t, s in store.types.items()}
    out = {"features": str(root / "features")}
    for kind, lora in (("full", None), ("lora", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"],
                                                 "lora_dropout": 0.0, "fan_in_fan_out": True})):
        model = TapmModel.from_decoder(AutoModelForCausalLM.from_pretrained(decoder), tokenizer, dims, tokens,
                                       seed=0, lora=lora)
        model.save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        out[kind] = str(root / kind)
    data = root / "data.jsonl"
    ids = [["img0", "img1", "img2"], ["img1", "img2", "img3"], ["img3", "img0", "img1"], ["img2", "img3", "img0"]]
    data.write_text("".join(json.dumps({"story_id": f"t{k}", "story": "a dog ran . the cat sat .", "image_ids": i})
                            + "\n" for k, i in enumerate(ids)))
    out["data"] = str(data)
    return out


def run_options(assets, tapm_dirs, out, algorithm, policy, lora, **extra):
    """A 2-step run of ``algorithm`` saving a checkpoint after step 1."""
    rewards = ["test_safety_words"]
    if algorithm == "ppo":
        base = {k: v for k, v in options(assets, out, "ppo", policy=policy if policy != "tapm" else "text",
                                         lora=lora).items() if k != "ppo"}
        section = {"per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 6,
                   "num_ppo_epochs": 2, "learning_rate": 1e-3, "save_steps": 1}
        if policy == "tapm":
            base.update(model=tapm_dirs["lora" if lora else "full"], data=tapm_dirs["data"], prompt="P1",
                        lora={"enabled": False})
            section["tapm_features"] = tapm_dirs["features"]
        return {**base, "rewards": rewards, "reward_weights": None, "max_steps": 2, "ppo": section, **extra}
    section = {"save_strategy": "steps", "save_steps": 1}
    return {**options(assets, out, algorithm, policy=policy, lora=lora, **{algorithm: section}),
            "rewards": rewards, "reward_weights": None, "max_steps": 2, **extra}


COMBOS = [(a, p, lora) for a in ("grpo", "rloo") for p in ("text", "vlm") for lora in (False, True)] + \
         [("ppo", p, lora) for p in ("text", "vlm", "tapm") for lora in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,policy,lora", COMBOS,
                         ids=[f"{a}-{p}-{'lora' if lora else 'full'}" for a, p, lora in COMBOS])
def test_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(assets, tapm_dirs, tmp_path, algorithm, policy,
                                                                   lora):
    """Killed during step 2 (after checkpoint-1), with a newer checkpoint
    half-written by the kill: --resume continues from the complete one and
    ends with the uninterrupted run's weights, bit for bit."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    def config(out):
        # seed 1: the tiny VLM's samples at seed 0 all get one reward on merged-LoRA sampling (no dropout
        # draws), so nothing would train and "step 2 changed the weights" could not be shown
        return RLConfig.from_mapping(run_options(assets, tapm_dirs, out, algorithm, policy, lora, seed=1))

    crashing_run(None)
    whole = train(config(tmp_path / "whole"), progress=False)
    crashing_run(2)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "cut"), progress=False)
    cut = tmp_path / "cut"
    assert (cut / "checkpoint-1").is_dir() and not (cut / "final").exists()
    # What a kill leaves while the next checkpoint is written: TRL writes
    # checkpoint-N in place (trainer_state.json last), storyrl's PPO writes aside.
    partial = cut / ("checkpoint-2.tmp" if algorithm == "ppo" else "checkpoint-2")
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half-written")
    crashing_run(None)
    resumed = train(config(cut), resume=True, progress=False)

    assert resumed.steps == whole.steps == 2
    a, b = final_tensors(whole.final_dir), final_tensors(resumed.final_dir)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    start = final_tensors(cut / "checkpoint-1") if algorithm != "ppo" else None
    if start is not None:  # step 2 changed the weights: equality is not trivially "nothing trained"
        shared = [k for k in a if k in start]
        assert shared and any(not np.array_equal(a[k], start[k]) for k in shared)
    rewards = lambda r: [e.get("rewards/test_safety_words/mean") for e in r.history if "step" in e]  # noqa: E731
    assert rewards(resumed)[-1] == rewards(whole)[-1]


# -- one run per output directory ---------------------------------------------------------------


@contextlib.contextmanager
def held_by_another_process(directory, seconds=15):
    """Another process holds ``directory``'s run lock for ``seconds`` (a
    lock that made the second run wait instead of failing would let it
    through once the holder ends: the tests then fail, not hang)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from storyrl.training.runs import lock_directory\n"
         "with lock_directory(sys.argv[1]):\n    print('held', flush=True); time.sleep(float(sys.argv[2]))",
         str(directory), str(seconds)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def rl_run(assets, out, **extra):
    from storyrl.training.storyteller.rl.config import RLConfig

    crashing_run(None)
    return RLConfig.from_mapping(run_options(assets, None, out, "grpo", "text", True, max_steps=1, **extra))


def test_an_existing_run_directory_is_refused_without_overwrite_and_cleared_with_it(assets, tmp_path):
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import LOCK_FILE, RunDirectoryError

    out = tmp_path / "run"
    first = train(rl_run(assets, out), progress=False)
    before = sorted(p.name for p in out.iterdir())
    history = (out / "history.jsonl").read_text()
    with pytest.raises(RunDirectoryError, match=r"already holds a run .*--resume.*--overwrite"):
        train(rl_run(assets, out), progress=False)
    assert sorted(p.name for p in out.iterdir()) == before and (out / "history.jsonl").read_text() == history
    stale = out / "checkpoint-99"
    stale.mkdir()
    (stale / "trainer_state.json").write_text("{}")
    second = train(rl_run(assets, out), progress=False, overwrite=True)
    assert not stale.exists() and second.steps == first.steps == 1
    assert sorted(p.name for p in out.iterdir()) == before and LOCK_FILE in before
    with pytest.raises(RunDirectoryError, match="exclude each other"):
        train(rl_run(assets, out), resume=True, overwrite=True, progress=False)


def test_only_global_rank_0_checks_clears_and_locks(tmp_path, monkeypatch):
    """On a second node LOCAL_RANK is 0 but RANK is not: that process must
    leave the directory alone (the run's rank 0 holds it)."""
    from storyrl.training.runs import is_main_process, run_directory

    out = tmp_path / "run"
    out.mkdir()
    (out / "history.jsonl").write_text("{}\n")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "3")
    assert not is_main_process()
    with run_directory(out, overwrite=True):
        assert [p.name for p in out.iterdir()] == ["history.jsonl"]  # neither cleared nor locked here
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert is_main_process()


def test_overwrite_removes_a_symlink_not_what_it_points_to(tmp_path):
    from storyrl.training.runs import run_directory

    elsewhere = tmp_path / "big_disk"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the run's")
    out = tmp_path / "run"
    out.mkdir()
    (out / "data").symlink_to(elsewhere, target_is_directory=True)
    (out / "checkpoint-1").mkdir()
    with run_directory(out, overwrite=True):
        assert [p.name for p in out.iterdir()] == [".storyrl-run.lock"]
    assert (elsewhere / "keep.txt").read_text() == "not the run's"


def test_an_output_dir_that_is_a_file_is_a_one_line_error(tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    out = tmp_path / "run"
    out.write_text("a file")
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"a": "One. Two."}))
    config = write_yaml(tmp_path / "c.yaml", {"output_dir": str(out), "stories": [str(one)]})
    result = CliRunner().invoke(main, ["train", "coherence", "--config", str(config), "-q"])
    assert result.exit_code == 1 and f"{out}: exists and is not a directory" in result.output
    assert "Traceback" not in result.output and out.read_text() == "a file"


def test_every_trainer_holds_its_run_directory():
    """Every registered trainer goes through runs.run_directory."""
    from storyrl.training import TRAINERS

    builtin = ["coherence", "rovist_vg", "vrank", "cosmic", "tapm", "rl"]
    assert set(builtin) <= set(TRAINERS.names())
    for name in builtin:
        function = TRAINERS.get(name).train
        assert getattr(function, "storyrl_guarded", False) and function.__wrapped__.__module__.startswith(
            "storyrl.training."), name


def test_a_trainer_registered_from_outside_gets_the_guard(tmp_path):
    from storyrl.training import Trainer
    from storyrl.training.config import TrainConfig
    from storyrl.training.runs import RunDirectoryError

    calls = []
    trainer = Trainer(TrainConfig, lambda config, resume=False, progress=True: calls.append(resume) or "done")
    out = tmp_path / "run"
    config = TrainConfig(output_dir=str(out))
    assert trainer.run(config) == "done"
    (out / "history.jsonl").write_text("{}\n")
    with pytest.raises(RunDirectoryError, match="already holds a run"):
        trainer.run(config)
    assert trainer.run(config, resume=True) == "done" and calls == [False, True]
    assert trainer.run(config, overwrite=True) == "done" and not (out / "history.jsonl").exists()


def test_cli_train_refuses_then_overwrites_a_fit_trainers_run(tmp_path):
    """`storyrl train coherence` (the fit-based trainers' path): refused
    over an earlier run, --overwrite replaces it, --resume with --overwrite
    is a usage error."""
    from click.testing import CliRunner

    from storyrl.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "history.jsonl").write_text('{"epoch": 1}\n')
    (out / "best").mkdir()
    one = tmp_path / "one.json"  # too few stories: the run fails once it has started
    one.write_text(json.dumps({"a": "One. Two."}))
    config = write_yaml(tmp_path / "c.yaml", {"output_dir": str(out), "stories": [str(one)]})
    runner = CliRunner()
    result = runner.invoke(main, ["train", "coherence", "--config", str(config), "-q"])
    assert result.exit_code == 1 and "already holds a run" in result.output and "--overwrite" in result.output
    assert (out / "history.jsonl").read_text() == '{"epoch": 1}\n'
    result = runner.invoke(main, ["train", "coherence", "--config", str(config), "--resume", "--overwrite"])
    assert result.exit_code == 2 and "exclude each other" in result.output
    with held_by_another_process(out):
        result = runner.invoke(main, ["train", "coherence", "--config", str(config), "--overwrite", "-q"])
        assert result.exit_code == 1 and f"{out}: in use by another run" in result.output
    assert (out / "best").is_dir()  # nothing removed while another run holds it
    # --overwrite clears the directory before the run starts (this one then fails on its missing data)
    result = runner.invoke(main, ["train", "coherence", "--config", str(config), "--overwrite", "-q"])
    assert result.exit_code == 1 and "at least 2 stories" in result.output
    assert not (out / "history.jsonl").exists() and not (out / "best").exists()


def test_a_second_run_on_a_locked_directory_fails_at_once(assets, tmp_path):
    """While one process holds the run directory (a subprocess here), a
    second train rl fails at once naming it, and leaves it untouched."""
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import RunDirectoryError

    out = tmp_path / "run"
    with held_by_another_process(out) as holder:
        with pytest.raises(RunDirectoryError, match=f"{out}: in use by another run"):
            train(rl_run(assets, out), progress=False)
        assert holder.poll() is None  # failed while the other run still held it: no waiting
        assert [p.name for p in out.iterdir()] == [".storyrl-run.lock"]


def test_ablate_locks_its_output_directory(tmp_path):
    from storyrl.eval.ablation import AblationConfig, run_ablation
    from storyrl.training.runs import RunDirectoryError

    stories = tmp_path / "a.json"
    stories.write_text(json.dumps({"s1": "A dog ran. A dog ran."}))
    human = tmp_path / "h.jsonl"
    human.write_text(json.dumps({"story_id": "s1", "story": "The cat sat. It slept."}) + "\n")
    config = AblationConfig.from_mapping({
        "output_dir": str(tmp_path / "abl"), "stories": {"a": str(stories)},
        "eval": {"data": str(human), "metrics": ["repetition"]}})
    with held_by_another_process(tmp_path / "abl"):
        with pytest.raises(RunDirectoryError, match="in use by another run"):
            run_ablation(config, progress=False)
    assert run_ablation(config, progress=False).variants[0].stories == 1


# -- runs that train nothing fail ------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo"])
def test_a_run_whose_reward_scores_no_story_fails_without_a_final_policy(assets, tmp_path, algorithm):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import RunFailedError

    out = tmp_path / "run"
    config = RLConfig.from_mapping(run_options(assets, None, out, algorithm, "text", True,
                                               rewards=["test_safety_nothing"], max_steps=3))
    with pytest.raises(RunFailedError, match=r"^step 1: no story was scorable: test_safety_nothing"):
        train(config, progress=False)
    assert not (out / "final").exists()
    history = read_jsonl(out / "history.jsonl")
    assert max(e.get("step", 0) for e in history) <= 1  # stopped at the first step, not after 3


def test_a_run_that_trains_zero_steps_fails(assets, tmp_path):
    """4 prompts cannot fill one GRPO step of 16 prompts: no step, an error, no final/."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import RunFailedError

    out = tmp_path / "run"
    options_ = run_options(assets, None, out, "grpo", "text", True, max_steps=None)
    options_["grpo"].update(per_device_train_batch_size=32, num_generations=2)
    with pytest.raises(RunFailedError, match=r"trained 0 steps: 4 prompts"):
        train(RLConfig.from_mapping(options_), progress=False)
    assert not (out / "final").exists()


def test_cli_failure_is_one_line(assets, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    config = write_yaml(tmp_path / "rl.yaml", run_options(assets, None, tmp_path / "out", "ppo", "text", True,
                                                          rewards=["test_safety_nothing"]))
    result = CliRunner().invoke(main, ["train", "rl", "--config", str(config), "-q"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert result.exit_code == 1 and len(errors) == 1 and "no story was scorable" in errors[0]
    assert "Traceback" not in result.output


# -- checkpoints that need no unpickling ---------------------------------------------------------


class _Planted:
    """Unpickling this runs code: it writes a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_resume_never_unpickles_a_planted_file(assets, tmp_path):
    """PPO and the fit loop keep the LR schedule's state in trainer_state.json
    (a resumed run keeps the uninterrupted run's rates); a
    custom_checkpoint_0.pkl planted in a checkpoint, which accelerate's
    load_state would unpickle, is refused by name and never loaded."""
    import torch

    from storyrl.training.config import TrainConfig
    from storyrl.training.loop import fit
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    # PPO
    marker = tmp_path / "pwned_ppo"
    crashing_run(None)
    options_ = run_options(assets, None, tmp_path / "ppo", "ppo", "text", True, max_steps=1)
    train(RLConfig.from_mapping(options_), progress=False)
    checkpoint = tmp_path / "ppo" / "checkpoint-1"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["scheduler"]["last_epoch"] == 4 and not list(checkpoint.glob("custom_*"))  # 2 epochs x 2 minibatches
    planted = checkpoint / "custom_checkpoint_0.pkl"
    planted.write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ValueError, match=f"{planted}: not a file storyrl writes"):
        train(RLConfig.from_mapping({**options_, "max_steps": 2}), resume=True, progress=False)
    assert not marker.exists()
    planted.unlink()
    assert train(RLConfig.from_mapping({**options_, "max_steps": 2}), resume=True, progress=False).steps == 2

    # the fit loop (vrank, cosmic, coherence, rovist_vg, tapm)
    marker = tmp_path / "pwned_fit"
    torch.manual_seed(0)
    data = [(torch.randn(2), int(k % 2)) for k in range(32)]

    def step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    def model():
        torch.manual_seed(0)
        return torch.nn.Linear(2, 2)

    cfg = lambda out, epochs: TrainConfig(output_dir=str(out), epochs=epochs, batch_size=8, lr=0.1,  # noqa: E731
                                          lr_decay=0.5, patience=5)
    whole = fit(model(), data, data[:8], cfg(tmp_path / "w", 3), step, progress=False)
    fit(model(), data, data[:8], cfg(tmp_path / "f", 1), step, progress=False)
    last = tmp_path / "f" / "last"
    assert json.loads((last / "trainer_state.json").read_text())["scheduler"]["last_epoch"] == 1
    (last / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ValueError, match="custom_checkpoint_0.pkl: not a file storyrl writes"):
        fit(model(), data, data[:8], cfg(tmp_path / "f", 3), step, resume=True, progress=False)
    assert not marker.exists()
    (last / "custom_checkpoint_0.pkl").unlink()
    resumed = fit(model(), data, data[:8], cfg(tmp_path / "f", 3), step, resume=True, progress=False)
    assert [h["lr"] for h in resumed.history] == [h["lr"] for h in whole.history] == [0.1, 0.05, 0.025]
    assert [h["val_loss"] for h in resumed.history] == [h["val_loss"] for h in whole.history]


def test_a_legacy_checkpoint_schedule_is_read_only_as_plain_data(tmp_path):
    """Checkpoints written before: the schedule in custom_checkpoint_0.pkl,
    read with weights_only=True (numbers load; code is refused), then moved
    aside so that accelerate's load_state does not unpickle it."""
    import torch

    from storyrl.training.checkpoints import scheduler_state

    class Accelerator:
        is_main_process = True

        def wait_for_everyone(self):
            pass

    legacy = tmp_path / "custom_checkpoint_0.pkl"
    torch.save({"last_epoch": 3, "base_lrs": [0.1]}, legacy)
    assert scheduler_state(Accelerator(), tmp_path, {}) == {"last_epoch": 3, "base_lrs": [0.1]}
    assert not legacy.exists() and (tmp_path / "custom_checkpoint_0.pkl.legacy").is_file()
    assert scheduler_state(Accelerator(), tmp_path, {}) == {"last_epoch": 3, "base_lrs": [0.1]}  # again, after a kill
    (tmp_path / "custom_checkpoint_0.pkl.legacy").unlink()
    legacy.write_bytes(pickle.dumps(_Planted(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="cannot be read safely"):
        scheduler_state(Accelerator(), tmp_path, {})
    assert not (tmp_path / "pwned").exists() and legacy.exists()


# -- strict RL configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    ({"grpo": {"learning_rate": "1e-3"}}, "grpo: key 'learning_rate': expected a number, got str"),
    ({"grpo": {"num_generations": 2.0}}, "grpo: key 'num_generations': expected"),
    ({"grpo": {"beta": float("nan")}}, "grpo: key 'beta': expected a number, got nan"),
    ({"grpo": {"learning_rate": float("inf")}}, "grpo: key 'learning_rate': expected a finite number, got inf"),
    ({"reward_weights": [1.0, float("-inf")]}, "reward_weights must be a finite number, got -inf"),
    ({"seed": 2**70}, "seed must be in 0..2..32-1 .what numpy and torch seed with., got 1180591620717411303424"),
    ({"reward_weights": [float("nan")]}, "reward_weights: every weight must be a finite number"),
    ({"reward_weights": [0.0]}, "reward_weights: every weight is 0"),
    ({"ppo": {"learning_rate": 1e-3}}, "ppo: options for algorithm ppo, but the run's algorithm is grpo"),
])
def test_rl_config_values_are_validated_not_converted(assets, tmp_path, change, message):
    from storyrl.training.storyteller.rl.config import RLConfig

    mapping = run_options(assets, None, tmp_path / "o", "grpo", "text", False)
    for key, value in change.items():
        mapping[key] = {**mapping[key], **value} if isinstance(value, dict) and key in mapping else value
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RLConfig.from_mapping(mapping)


def test_nested_ppo_options_refuse_nan(assets, tmp_path):
    from storyrl.training.storyteller.rl.config import RLConfig

    mapping = run_options(assets, None, tmp_path / "o", "ppo", "text", False)
    mapping["ppo"]["learning_rate"] = math.nan
    with pytest.raises(ValueError, match="learning_rate must be a number, got nan"):
        RLConfig.from_mapping(mapping)


def test_trl_values_their_docs_admit_are_kept_as_given(assets, tmp_path):
    """scale_rewards is annotated str but documented `str` or `bool`: a bool
    passes to TRL (which maps it); an int save_steps stays an int."""
    from storyrl.training.storyteller.rl.config import RLConfig

    mapping = run_options(assets, None, tmp_path / "o", "grpo", "text", False)
    mapping["grpo"].update(scale_rewards=False, save_steps=3)
    config = RLConfig.from_mapping(mapping)
    assert config.grpo.scale_rewards == "none" and config.grpo.save_steps == 3


# -- several processes ---------------------------------------------------------------------------


@pytest.mark.slow
def test_two_ppo_processes_share_one_run(assets, tmp_path):
    """`torch.distributed.run --nproc_per_node 2 -m storyrl train rl` with
    PPO: one run of 2 processes (not two single-process copies): each step
    rolls out 2 prompts per process (episode = 4 per step), and the main
    process alone writes history and samples, once per step."""
    config = run_options(assets, None, tmp_path / "out", "ppo", "text", True)
    config["rewards"] = ["rouge_l"]
    config["ppo"].update(per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1, save_steps=1)
    train_two_processes(write_yaml(tmp_path / "rl.yaml", config))
    history = read_jsonl(tmp_path / "out" / "history.jsonl")
    assert [h["step"] for h in history] == [1, 2] and [h["episode"] for h in history] == [4.0, 8.0]
    samples = read_jsonl(tmp_path / "out" / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 2]
    assert (tmp_path / "out" / "final" / "adapter_model.safetensors").is_file()


def test_ppo_processes_roll_out_different_prompts(assets, tmp_path):
    """The rows of one step: process k takes the k-th block of the global
    batch, so two processes never roll out the same prompts in a step."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.args = type("A", (), {"per_device_train_batch_size": 2, "seed": 0})()
    trainer.train_dataset = [{"i": k} for k in range(6)]
    trainer.global_batch, trainer._orders = 4, {}
    rows = {}
    for rank in (0, 1):
        trainer.accelerator = type("Acc", (), {"process_index": rank})()
        rows[rank] = [r["i"] for r in trainer._rows(0)]
    assert len(set(rows[0]) | set(rows[1])) == 4 and not set(rows[0]) & set(rows[1])


@pytest.mark.slow
def test_process_state_then_an_accelerator_see_every_process(tmp_path):
    """The trainers read the main process from runs.process_state() before
    their accelerator exists: under torchrun on CPU both must see 2
    processes (a bare PartialState() saw 1 and made the accelerator see 1)."""
    script = tmp_path / "probe.py"
    script.write_text("import storyrl, torch\nfrom accelerate import Accelerator\n"
                      "from storyrl.training.runs import process_state\n"
                      "state = process_state()\n"
                      "acc = Accelerator(cpu=not torch.cuda.is_available())\n"
                      "import sys, pathlib\n"
                      "pathlib.Path(sys.argv[1], f'seen{acc.process_index}').write_text("
                      "f'{state.num_processes} {acc.num_processes}')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          str(script), str(tmp_path)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    seen = {p.name: p.read_text() for p in tmp_path.glob("seen*")}
    assert seen == {"seen0": "2 2", "seen1": "2 2"}, out.stderr[-2000:]


# -- train rl's own wiring (survivors of the break review) -----------------------------------------


@register_reward()
class _Chars(Reward):
    """Test reward: a hundredth of the character count (always scorable)."""

    name = "test_safety_chars"

    def _score_batch(self, stories, **context):
        return np.array([len(s) / 100 for s in stories])


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_reward_weights_reach_the_algorithm(assets, tmp_path, algorithm):
    """The logged reward of a step is the weighted sum of the rewards' means
    (every story scorable by both): the run's reward_weights, not 1 and 1."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    crashing_run(None)
    options_ = run_options(assets, None, tmp_path / "run", algorithm, "text", True, max_steps=1,
                           rewards=["test_safety_words", "test_safety_chars"], reward_weights=[2.0, -0.5])
    result = train(RLConfig.from_mapping(options_), progress=False)
    entry = next(e for e in result.history if "rewards/test_safety_chars/mean" in e)
    expected = 2.0 * entry["rewards/test_safety_words/mean"] - 0.5 * entry["rewards/test_safety_chars/mean"]
    assert entry["reward"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_resume_without_a_checkpoint_starts_afresh(assets, tmp_path, caplog, algorithm):
    import logging

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    crashing_run(None)
    options_ = run_options(assets, None, tmp_path / "run", algorithm, "text", True, max_steps=1)
    with caplog.at_level(logging.WARNING, logger="storyrl.training"):
        result = train(RLConfig.from_mapping(options_), resume=True, progress=False)
    assert result.steps == 1 and "starting from the beginning" in caplog.text


def test_a_reward_that_cannot_load_leaves_the_directory_empty(assets, tmp_path):
    """The run fails before writing anything, so it can be started again
    without --overwrite."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    out = tmp_path / "run"
    options_ = run_options(assets, None, out, "grpo", "text", True,
                           rewards=[{"reward": "coherence", "model": str(tmp_path / "no_model")}])
    with pytest.raises(ValueError, match="no_model"):
        train(RLConfig.from_mapping(options_), progress=False)
    assert [p.name for p in out.iterdir()] == [".storyrl-run.lock"]


def test_the_saved_config_and_resume_warnings(assets, tmp_path, caplog, monkeypatch):
    """rl_config.yaml is written by global rank 0 only; resuming with a
    longer max_steps says nothing, with another learning rate it warns."""
    import logging

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import CONFIG_FILE, _save_config

    out = tmp_path / "run"
    config = RLConfig.from_mapping(run_options(assets, None, out, "grpo", "text", True))
    monkeypatch.setenv("RANK", "1")
    _save_config(config, resume=False)
    assert not (out / CONFIG_FILE).exists()
    monkeypatch.setenv("RANK", "0")
    _save_config(config, resume=False)
    assert RLConfig.from_yaml(out / CONFIG_FILE).to_dict() == config.to_dict()
    longer = RLConfig.from_mapping({**run_options(assets, None, out, "grpo", "text", True), "max_steps": 9})
    with caplog.at_level(logging.WARNING, logger="storyrl.training.storyteller.rl.train"):
        _save_config(longer, resume=True)
    assert "differs" not in caplog.text
    options_ = run_options(assets, None, out, "grpo", "text", True)
    options_["grpo"]["learning_rate"] = 0.5
    with caplog.at_level(logging.WARNING, logger="storyrl.training.storyteller.rl.train"):
        _save_config(RLConfig.from_mapping(options_), resume=True)
    assert "the config differs from the saved one in grpo" in caplog.text


def test_quiet_runs_restore_the_progress_bars(assets, tmp_path):
    from transformers.utils import logging as hf_logging

    from storyrl.training.storyteller.rl.train import train

    hf_logging.enable_progress_bar()
    train(rl_run(assets, tmp_path / "run"), progress=False)
    assert hf_logging.is_progress_bar_enabled()


def test_summary_reports_the_last_finite_reward():
    from storyrl.training.storyteller.rl.train import RLResult

    result = RLResult(algorithm="grpo", output_dir="out", steps=3, history=[{"reward": 0.1}, {"loss": 1.0}, {"reward": 0.7}])
    assert result.summary() == {"algorithm": "grpo", "output_dir": "out", "final": str(Path("out") / "final"),
                                "steps": 3, "last_reward": 0.7}
    assert RLResult(algorithm="ppo", output_dir="out", steps=1, history=[{"reward": math.nan}]).summary()["last_reward"] is None


def test_only_the_main_process_rewrites_the_logs_on_train_begin(tmp_path):
    from types import SimpleNamespace

    from storyrl.training.storyteller.rl.trl_trainers import HistoryCallback

    (tmp_path / "history.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "samples.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    callback = HistoryCallback(tmp_path)
    args = SimpleNamespace(output_dir=str(tmp_path))
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=False, log_history=[], global_step=0), None)
    assert (tmp_path / "history.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True, log_history=[{"step": 1, "loss": 0.5}],
                                                  global_step=1, max_steps=2), None)
    assert read_jsonl(tmp_path / "history.jsonl") == [{"step": 1, "loss": 0.5}]
    assert read_jsonl(tmp_path / "samples.jsonl") == [{"step": 1}]


def test_a_dataset_of_exactly_one_generation_round_trains(assets, tmp_path):
    """4 prompts, rounds of 4 prompts (8 completions, 2 per prompt): one step."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    crashing_run(None)
    options_ = run_options(assets, None, tmp_path / "run", "grpo", "text", True, max_steps=1)
    options_["grpo"].update(per_device_train_batch_size=8, num_generations=2)
    assert train(RLConfig.from_mapping(options_), progress=False).steps == 1


def test_scorable_check_by_hand():
    """Fails the run only at a logged step where no reward with a non-zero
    weight has a mean, and only while no earlier step (a resumed run's
    included) scored a story."""
    from types import SimpleNamespace

    from storyrl.training.storyteller.rl.trl_trainers import ScorableCheck

    nan = float("nan")

    def run(logs_seq, history=(), weights=(1.0, 0.0, 2.0)):
        check = ScorableCheck(["a", "b", "c"], list(weights))
        state = SimpleNamespace(log_history=list(history), global_step=0)
        check.on_train_begin(None, state, None)
        control = SimpleNamespace(should_training_stop=False)
        for step, logs in enumerate(logs_seq, 1):
            state.global_step = step
            check.on_log(None, state, control, logs=logs)
            if control.should_training_stop:
                return check.failure
        return None

    m = lambda a, b, c: {"rewards/a/mean": a, "rewards/b/mean": b, "rewards/c/mean": c}  # noqa: E731
    assert run([m(nan, 0.5, nan)]).startswith("step 1: no story was scorable: a, c returned")  # b weighs 0
    assert run([m(nan, nan, 0.3)]) is None  # one weighted reward scored: enough
    assert run([m(0.1, nan, nan), m(nan, nan, nan)]) is None  # scored before: later steps only warn
    assert run([{"loss": 1.0}, m(nan, nan, nan)]).startswith("step 2: no story was scorable")  # no reward key
    assert run([m(nan, nan, nan)], history=[m(0.2, nan, nan)]) is None  # resumed after scored steps
    assert run([m(None, 1.0, None)]) is not None  # TRL writes a NaN mean as null in some logs


def test_latest_complete_checkpoint_by_hand(tmp_path):
    from storyrl.training.storyteller.rl.trl_trainers import latest_complete_checkpoint

    def checkpoint(step, state_step=None, state=True):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        if state:
            (path / "trainer_state.json").write_text(json.dumps({"global_step": step if state_step is None
                                                                 else state_step}))
        return path

    assert latest_complete_checkpoint(tmp_path / "missing") is None
    checkpoint(2)
    nine = checkpoint(9)
    checkpoint(10, state=False)  # killed before trainer_state.json
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-12" / "trainer_state.json").write_text('{"global_st')  # cut mid-write
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_complete_checkpoint(tmp_path) == nine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-9", "checkpoint-x"]
    # A complete state naming another step: not this run's checkpoint (planted, copied); refused, kept.
    eleven = checkpoint(11, state_step=7)
    with pytest.raises(ValueError, match=f"^{eleven}: its trainer state records step 7, its name step 11"):
        latest_complete_checkpoint(tmp_path)
    assert eleven.is_dir()


def test_ppo_trainer_steps_and_weights(tmp_path):
    """Without max_steps a run is ceil(prompts x epochs / global batch) steps
    (6 prompts, 4 per step: 2, the last one wrapping into the next pass);
    all-zero reward weights are refused."""
    import tiny_models
    from datasets import Dataset

    from storyrl.training.storyteller.rl.ppo import PPOTrainer
    from storyrl.training.storyteller.rl.ppo.config import PPOConfig

    tokenizer = tiny_models.chat_tokenizer(["a dog ran . the cat sat ."])
    data = Dataset.from_dict({"prompt": ["a dog"] * 6, "story_id": [f"s{k}" for k in range(6)]})
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, save_steps=None)
    reward = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731
    reward.__name__ = "one"
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), reward, args, data, processing_class=tokenizer)
    assert trainer.num_steps == 2
    args3 = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, save_steps=None,
                      num_train_epochs=3)
    assert PPOTrainer(tiny_models.tiny_llama(tokenizer), reward, args3, data,
                      processing_class=tokenizer).num_steps == 5
    with pytest.raises(ValueError, match="every reward weight is 0"):
        PPOTrainer(tiny_models.tiny_llama(tokenizer), reward, args, data, processing_class=tokenizer,
                   reward_weights=[0.0])


def test_a_checkpoint_of_another_architecture_is_refused(tmp_path):
    """load_full_weights: every key of the policy must come from the
    checkpoint (a 1-layer checkpoint into a 2-layer policy leaves layer 1
    'missing'); a matching one loads exactly."""
    import tiny_models
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from storyrl.training.storyteller.rl.trl_trainers import load_full_weights

    tokenizer = tiny_models.chat_tokenizer(["a dog ran ."])
    policy = tiny_models.tiny_llama(tokenizer)
    saved = tiny_models.tiny_llama(tokenizer, seed=1)
    saved.save_pretrained(tmp_path / "same")
    assert load_full_weights(policy, tmp_path / "same")
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), saved.state_dict().values()))
    config = LlamaConfig(**{**policy.config.to_dict(), "num_hidden_layers": policy.config.num_hidden_layers - 1})
    LlamaForCausalLM(config).save_pretrained(tmp_path / "shallow")
    with pytest.raises(ValueError, match="do not fit the policy"):
        load_full_weights(policy, tmp_path / "shallow")
    assert not load_full_weights(policy, tmp_path)  # no weights file: left to the Trainer (adapters)


def test_story_statistics_that_are_nan_are_not_logged():
    """distinct-n of a batch without n-grams is NaN: not sent to TRL's log."""
    from storyrl.training.storyteller.rl.trl_trainers import StoryMonitor

    logged = {}
    monitor = StoryMonitor([1.0], None)
    (reward,) = monitor.wrap([lambda prompts=None, completions=None, **kw: [None] * len(completions)])
    reward(prompts=["p", "p"], completions=["", ""], log_metric=logged.__setitem__, completion_ids=[[], []])
    assert logged["story/empty_frac"] == 1.0 and not any(k.startswith("story/distinct") for k in logged)
    assert all(math.isfinite(v) for v in logged.values())


GAPS = {"unscorable_calls": set(), "calls": 0}


@register_reward()
class _Gaps(Reward):
    """Test reward: word count / 10, every story unscorable at the calls
    listed in GAPS['unscorable_calls'] (1-based, counted over the process)."""

    name = "test_safety_gaps"

    def _score_batch(self, stories, **context):
        GAPS["calls"] += 1
        if GAPS["calls"] in GAPS["unscorable_calls"]:
            return np.full(len(stories), np.nan)
        return np.array([len(s.split()) / 10 for s in stories])


def gaps(*calls):
    GAPS.update(unscorable_calls=set(calls), calls=0)


def strict_jsonl(path):
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


def test_ppo_logs_and_checkpoints_the_last_step_and_resumes_its_logs(assets, tmp_path):
    """logging_steps 2 / save_steps 2 over 3 steps: steps 2 and 3 logged and
    checkpointed; history.jsonl is strict JSON (NaN written as null); a run
    resumed from checkpoint-2 after step 3 was logged (killed before its
    checkpoint) holds each step once."""
    import shutil

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    gaps()
    options_ = run_options(assets, None, tmp_path / "run", "ppo", "text", True, max_steps=3,
                           rewards=["test_safety_gaps"])
    options_["ppo"].update(logging_steps=2, save_steps=2, per_device_train_batch_size=2, num_mini_batches=1)
    train(RLConfig.from_mapping(options_), progress=False)
    out = tmp_path / "run"
    history = strict_jsonl(out / "history.jsonl")
    assert [h["step"] for h in history] == [2, 3]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert [s["step"] for s in strict_jsonl(out / "samples.jsonl")] == [2, 3]
    shutil.rmtree(out / "checkpoint-3")
    shutil.rmtree(out / "final")
    gaps()
    train(RLConfig.from_mapping(options_), resume=True, progress=False)
    assert [h["step"] for h in strict_jsonl(out / "history.jsonl")] == [2, 3]
    assert [s["step"] for s in strict_jsonl(out / "samples.jsonl")] == [2, 3]


def test_ppo_an_unscorable_step_after_scored_ones_only_warns(assets, tmp_path, caplog):
    import logging

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    options_ = run_options(assets, None, tmp_path / "run", "ppo", "text", True, max_steps=2,
                           rewards=["test_safety_gaps"])
    gaps(2)  # step 2 scores nothing
    with caplog.at_level(logging.WARNING, logger="storyrl.training.storyteller.rl.ppo"):
        result = train(RLConfig.from_mapping(options_), progress=False)
    assert result.steps == 2 and "step 2: no story was scorable" in caplog.text
    assert [h["reward"] is None for h in result.history] == [False, True]
    assert [h["reward"] is None for h in strict_jsonl(tmp_path / "run" / "history.jsonl")] == [False, True]
    # resumed after a scored step (checkpoint-1), the next unscorable step only warns too
    options_ = {**options_, "max_steps": 2, "output_dir": str(tmp_path / "again")}
    gaps()
    train(RLConfig.from_mapping({**options_, "max_steps": 1}), progress=False)
    gaps(1)
    assert train(RLConfig.from_mapping(options_), resume=True, progress=False).steps == 2


def test_fit_checkpoint_files_after_a_kill_mid_swap(tmp_path):
    """A kill between the renames of swap_in: last/ (new, complete) and
    last.old both there -> resume takes last/; best.old there -> it is the
    best/ that goes with the checkpoint and replaces a newer best/."""
    from storyrl.training.checkpoints import TRAINER_STATE, find_checkpoint, restore_best

    for name, step in (("last", 2), ("last.old", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    assert find_checkpoint(tmp_path) == tmp_path / "last"
    (tmp_path / "last" / TRAINER_STATE).unlink()  # killed while last/ was written: the old one
    assert find_checkpoint(tmp_path) == tmp_path / "last.old"
    for name in ("best", "best.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.pt").write_text(name)
    restore_best(tmp_path)
    assert (tmp_path / "best" / "model.pt").read_text() == "best.old" and not (tmp_path / "best.old").exists()


def test_rl_config_keeps_what_the_user_gave_and_flows_run_keys(assets, tmp_path):
    """The user's use_cpu/bf16 win over the CPU defaults; max_steps null
    reaches TRL as -1 (its 'not set'); a zero weight next to a non-zero one
    is allowed, and run-level values are kept as checked (ints as floats)."""
    from storyrl.training.storyteller.rl.config import RLConfig

    mapping = run_options(assets, None, tmp_path / "o", "grpo", "text", False, max_steps=None)
    mapping["grpo"].update(use_cpu=False, bf16=False)
    config = RLConfig.from_mapping(mapping)
    assert config.grpo.use_cpu is False and config.grpo.max_steps == -1
    mapping = run_options(assets, None, tmp_path / "o", "grpo", "text", False,
                          rewards=["test_safety_words", "test_safety_chars"], reward_weights=[1, 0])
    config = RLConfig.from_mapping(mapping)
    assert config.reward_weights == [1.0, 0.0] and all(type(w) is float for w in config.reward_weights)
    assert config.grpo.reward_weights == [1.0, 0.0]
