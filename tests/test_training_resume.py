"""``--resume`` never trains what the run did not ask for (issue 31, items 5,
6 and 8): a finished run resumed is a no-op (every file as it was, the same
summary), a run killed after its last checkpoint writes final/ without a
step past max_steps (transformers' Trainer trains one more when the run
ended inside an epoch), a checkpoint past max_steps or named for another
step is refused, and an unreadable checkpoint file is named in one line.

Tiny random-weight runs of SFT, DPO, GRPO and PPO (tests/tiny_models.py);
each run ends inside its first epoch (2 rows, 1 per step, max_steps 1)."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
from test_rl_train import options as rl_options  # (and registers its test_rl_words reward)
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]

pytestmark = pytest.mark.usefixtures("trl_offline")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k:k + 2]),
                                        "images": images}) + "\n" for k in range(2)), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": P1.format(n="three"), "chosen": TAPM_TEXTS[k],
                                         "rejected": TAPM_TEXTS[k + 2], "images": images, "story_id": f"s{k}"})
                             + "\n" for k in range(2)), encoding="utf-8")
    return {"root": root, "data": str(data), "pairs": str(pairs), "model": save_tiny_llama(root / "llama", TEXTS)}


@pytest.fixture(scope="module")
def rl_assets(assets):
    """What test_rl_train's options read: 4 prompts (GRPO: 2 per step)."""
    data = assets["root"] / "rl_data.jsonl"
    images = [str(p) for p in sorted((assets["root"] / "images").iterdir())]
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k:k + 2]),
                                        "images": images}) + "\n" for k in range(4)), encoding="utf-8")
    return {"data": str(data), "text": assets["model"]}


def storyteller(kind: str, assets, out, **extra):
    """(config, train) of a 1-step SFT or DPO run of 2 rows, one per step
    (so it ends inside its first epoch), a checkpoint at every step."""
    options = {"model": assets["model"], "data": assets["data"], "output_dir": str(out), "prompt": "P1",
               "max_steps": 1, "batch_size": 1, "learning_rate": 1e-3, "logging_steps": 1, "save_steps": 1,
               "seed": 0, **extra}
    if kind == "sft":
        from storyrl.training.storyteller.sft import SFTRunConfig, train
        return SFTRunConfig.from_mapping(options), train
    from storyrl.training.storyteller.dpo import DPORunConfig, train
    return DPORunConfig.from_mapping({**options, "pairs": assets["pairs"]}), train


def rl(rl_assets, out, algorithm, **extra):
    """A 1-step GRPO (4 prompts, 2 per step: inside its first epoch) or PPO run, a checkpoint every step."""
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    section = {"save_strategy": "steps", "save_steps": 1} if algorithm == "grpo" else \
        {"per_device_train_batch_size": 2, "num_mini_batches": 1, "response_length": 6, "num_ppo_epochs": 1,
         "save_steps": 1}
    options = rl_options(rl_assets, out, algorithm, lora=True, **{algorithm: section})
    if algorithm == "ppo":  # (test_rl_train's options give every algorithm GRPO's keys)
        options["ppo"] = section
    options.update({"rewards": ["test_rl_words"], "reward_weights": None, "max_steps": 1, **extra})
    return RLConfig.from_mapping(options), train


def snapshot(directory: Path) -> dict[str, tuple]:
    """Every file's (mtime, size, sha256) and every directory's mtime under ``directory``."""
    out = {}
    for path in sorted([directory, *directory.rglob("*")]):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[str(path.relative_to(directory))] = (stat.st_mtime_ns, stat.st_size, digest)
    return out


def losses(history: list[dict]) -> list[int]:
    return [entry["step"] for entry in history if "loss" in entry]


# -- a finished run resumed is a no-op ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_finished_run_resumed_changes_nothing(assets, tmp_path, kind):
    config, train = storyteller(kind, assets, tmp_path / "run")
    first = train(config, progress=False)
    assert first.steps == 1
    before = snapshot(tmp_path / "run")
    for _ in range(2):  # each further resume added a step before
        again = train(config, resume=True, progress=False)
        assert again.summary() == first.summary()
        assert snapshot(tmp_path / "run") == before


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_finished_rl_run_resumed_changes_nothing(rl_assets, tmp_path, algorithm):
    config, train = rl(rl_assets, tmp_path / "run", algorithm)
    first = train(config, progress=False)
    assert first.steps == 1
    before = snapshot(tmp_path / "run")
    again = train(config, resume=True, progress=False)
    assert again.summary() == first.summary()
    assert snapshot(tmp_path / "run") == before


# -- killed after the last checkpoint: final/ without a step more --------------------------------------


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_kill_after_the_last_checkpoint_writes_final_without_training(assets, tmp_path, kind):
    from test_run_safety import final_tensors

    config, train = storyteller(kind, assets, tmp_path / "run")
    train(config, progress=False)
    expected = final_tensors(tmp_path / "run" / "final")
    history = (tmp_path / "run" / "history.jsonl").read_text()
    shutil.rmtree(tmp_path / "run" / "final")  # killed before final/ was written
    result = train(config, resume=True, progress=False)
    assert result.steps == 1 and losses(result.history) == [1]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "run" / "history.jsonl").read_text() == history
    got = final_tensors(tmp_path / "run" / "final")
    assert got.keys() == expected.keys() and all((got[k] == expected[k]).all() for k in got)


def test_a_kill_after_the_last_grpo_checkpoint_writes_final_without_training(rl_assets, tmp_path):
    config, train = rl(rl_assets, tmp_path / "run", "grpo")
    train(config, progress=False)
    shutil.rmtree(tmp_path / "run" / "final")
    samples = (tmp_path / "run" / "samples.jsonl").read_text()
    result = train(config, resume=True, progress=False)
    assert result.steps == 1
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    assert (tmp_path / "run" / "samples.jsonl").read_text() == samples  # no step was sampled
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


def test_a_longer_max_steps_on_resume_trains_on(assets, tmp_path):
    """Not a no-op: the config asks for more steps than final/ holds."""
    config, train = storyteller("sft", assets, tmp_path / "run")
    train(config, progress=False)
    longer, _ = storyteller("sft", assets, tmp_path / "run", max_steps=2)
    result = train(longer, resume=True, progress=False)
    assert result.steps == 2 and losses(result.history) == [1, 2]


# -- planted checkpoints --------------------------------------------------------------------------------


def plant(run: Path, name: str, step: int, max_steps: int = 40) -> Path:
    """A copy of checkpoint-1 named ``name`` whose state says ``step``."""
    planted = run / name
    if planted != run / "checkpoint-1":
        shutil.copytree(run / "checkpoint-1", planted)
    state = json.loads((planted / "trainer_state.json").read_text())
    state.update(global_step=step, max_steps=max_steps)
    (planted / "trainer_state.json").write_text(json.dumps(state))
    return planted


@pytest.fixture(scope="module")
def finished_sft(assets, tmp_path_factory):
    """A finished 1-step SFT run (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    config, train = storyteller("sft", assets, out)
    train(config, progress=False)
    return out


def copy_run(finished_sft, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished_sft, run)
    shutil.rmtree(run / "final")  # so that a resume would train
    return run


@pytest.mark.parametrize("max_steps", [40, None])
def test_a_checkpoint_past_max_steps_is_refused(assets, finished_sft, tmp_path, max_steps):
    """max_steps given: refused before anything is built; epochs (2 steps):
    refused when the trainer has counted the run's steps."""
    run = copy_run(finished_sft, tmp_path)
    planted = plant(run, "checkpoint-99", 99)
    config, train = storyteller("sft", assets, run, max_steps=max_steps)
    limit = 40 if max_steps else 2
    with pytest.raises(ValueError, match=f"^{planted}: at step 99, past this run's max_steps {limit}; "):
        train(config, resume=True, progress=False)
    assert planted.is_dir() and not (run / "final").exists()


def test_a_checkpoint_whose_state_names_another_step_is_refused(assets, finished_sft, tmp_path):
    run = copy_run(finished_sft, tmp_path)
    planted = plant(run, "checkpoint-1", 99)
    config, train = storyteller("sft", assets, run, max_steps=40)
    with pytest.raises(ValueError, match=f"^{planted}: its trainer state records step 99, its name step 1"):
        train(config, resume=True, progress=False)
    assert planted.is_dir()  # refused, not removed as an incomplete one


def test_a_planted_ppo_checkpoint_is_refused(rl_assets, tmp_path):
    config, train = rl(rl_assets, tmp_path / "run", "ppo")
    train(config, progress=False)
    run = tmp_path / "run"
    planted = run / "checkpoint-99"
    shutil.copytree(run / "checkpoint-1", planted)
    state = json.loads((planted / "trainer_state.json").read_text())
    (planted / "trainer_state.json").write_text(json.dumps({**state, "step": 99}))
    longer, _ = rl(rl_assets, run, "ppo", max_steps=40)
    with pytest.raises(ValueError, match=f"^{planted}: at step 99, past this run's max_steps 40"):
        train(longer, resume=True, progress=False)
    (planted / "trainer_state.json").write_text(json.dumps({**state, "step": 1}))
    with pytest.raises(ValueError, match=f"^{planted}: its trainer state records step 1, its name step 99"):
        train(longer, resume=True, progress=False)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_checkpoint_past_max_steps_is_refused_on_a_finished_rl_run(rl_assets, tmp_path, algorithm):
    """--resume on a finished RL run is a no-op, but not a way to hide a
    checkpoint past max_steps planted beside it."""
    config, train = rl(rl_assets, tmp_path / "run", algorithm)
    train(config, progress=False)
    run = tmp_path / "run"
    planted = run / "checkpoint-99"
    shutil.copytree(run / "checkpoint-1", planted)
    key = "step" if algorithm == "ppo" else "global_step"
    state = json.loads((planted / "trainer_state.json").read_text())
    (planted / "trainer_state.json").write_text(json.dumps({**state, key: 99}))
    with pytest.raises(ValueError, match=f"^{planted}: at step 99, past this run's max_steps 1"):
        train(config, resume=True, progress=False)


# -- unreadable files are named --------------------------------------------------------------------------


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name,content", [
    ("model.safetensors", b"\xff" * 64),  # a header length past the file
    ("optimizer.pt", b"garbage, not a torch file"),
    ("rng_state.pth", "planted"),  # a pickle that runs code
    ("scheduler.pt", b""),
], ids=["cut-safetensors", "garbage-optimizer", "planted-rng-pickle", "empty-scheduler"])
def test_an_unreadable_checkpoint_file_is_named(assets, finished_sft, tmp_path, name, content):
    run = copy_run(finished_sft, tmp_path)
    marker = tmp_path / "pwned"
    path = run / "checkpoint-1" / name
    path.write_bytes(pickle.dumps(_Planted(marker)) if content == "planted" else content)
    config, train = storyteller("sft", assets, run, max_steps=2)
    with pytest.raises(ValueError, match=f"^{path}: ") as info:
        train(config, resume=True, progress=False)
    assert "\n" not in str(info.value) and not marker.exists()


def test_the_files_transformers_writes_pass_the_check(finished_sft):
    from storyrl.training.guards import check_checkpoint_files

    check_checkpoint_files(finished_sft / "checkpoint-1")  # optimizer, scheduler, RNG (numpy) state, weights
    assert {p.name for p in (finished_sft / "checkpoint-1").iterdir()} >= {
        "model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}


def test_a_corrupted_model_file_is_named(assets, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:100])  # cut short
    config, train = storyteller("sft", {**assets, "model": str(model)}, tmp_path / "run")
    with pytest.raises(ValueError, match=f"^{model / 'model.safetensors'}: not a readable safetensors file"):
        train(config, progress=False)


def test_dpo_with_no_example_left_after_max_length_names_it(assets, tmp_path):
    config, train = storyteller("dpo", assets, tmp_path / "run", max_length=1)
    with pytest.raises(ValueError, match="^max_length 1: no training example is left"):
        train(config, progress=False)


def test_a_finished_reward_model_resumed_changes_nothing(assets, tmp_path):
    """The reward model trains through its own train() (held-out pairs,
    pair accuracy): resumed when finished it is a no-op too; killed after
    its last checkpoint, final/ is written without a step more."""
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, train

    config = RewardModelRunConfig.from_mapping({
        "model": assets["model"], "pairs": assets["pairs"], "output_dir": str(tmp_path / "run"), "max_steps": 1,
        "batch_size": 1, "logging_steps": 1, "save_steps": 1, "eval_fraction": 0.0, "seed": 0})
    first = train(config, progress=False)
    assert first.steps == 1
    before = snapshot(tmp_path / "run")
    for _ in range(2):
        again = train(config, resume=True, progress=False)
        assert again.summary() == first.summary()
        assert snapshot(tmp_path / "run") == before
    shutil.rmtree(tmp_path / "run" / "final")  # killed before final/ was written
    again = train(config, resume=True, progress=False)
    assert again.steps == 1 and (tmp_path / "run" / "final").is_dir()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]
    assert [e["step"] for e in map(json.loads, (tmp_path / "run" / "history.jsonl").read_text().splitlines())
            if "loss" in e] == [1]
