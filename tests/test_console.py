"""storyrl.console: what a command prints without and with --verbose, and
progress bars in logs. The noise is produced by the libraries' own calls
(transformers' TrainingArguments, TRL's trainer, accelerate's safetensors
cleaning, open_clip's loader), each in a fresh interpreter: the policy is
process-wide."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_models import TAPM_TEXTS, save_tiny_clip, save_tiny_llama, write_images

from storyrl import console

ROOT = Path(__file__).resolve().parents[1]
VARIABLES = ("STORYRL_VERBOSE", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY", "DATASETS_VERBOSITY",
             "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "PYTHONWARNINGS"}
    return {**env, "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true", "OMP_NUM_THREADS": "1", **extra}


class TtyStringIO(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- progress bars ------------------------------------------------------------------------------


def nested_bars(stream) -> str:
    """What loop.py does: an outer bar, and inner bars at position 1 under it."""
    outer = console.progress(total=2, desc="epochs", file=stream, position=0)
    for epoch in range(2):
        inner = console.progress(range(3), desc=f"epoch {epoch}", leave=False, file=stream, position=1)
        assert list(inner) == [0, 1, 2]  # disabled or not, the items all come through
        inner.close()
        outer.update()
    outer.close()
    return stream.getvalue()


def test_progress_in_a_log_has_no_cursor_moves_and_one_plain_bar():
    text = nested_bars(io.StringIO())
    assert "\x1b[A" not in text
    assert "epoch 0" not in text and "epoch 1" not in text  # the nested bars are off
    assert "epochs: 100%" in text and "2/2" in text  # the outer bar's final line is there


def test_progress_on_a_terminal_is_tqdm_as_asked():
    text = nested_bars(TtyStringIO())
    assert "\x1b[A" in text  # nested bars draw below the outer one, as before
    assert "epoch 0" in text and "epochs: 100%" in text


def test_progress_bar_opened_under_another_is_nested_in_a_log_even_without_position():
    stream = io.StringIO()
    with console.progress(total=1, file=stream) as outer:
        inner = console.progress(total=1, file=stream)
        assert inner.disable and not outer.disable
        inner.close()
    assert console.progress(total=1, file=stream, nested=True).disable


def test_progress_options():
    log, tty = io.StringIO(), TtyStringIO()
    assert console.progress(total=1, file=log).mininterval == console.PLAIN_MININTERVAL_S
    assert console.progress(total=1, file=log, mininterval=1.0).mininterval == 1.0  # the caller's wins
    assert console.progress(total=1, file=tty).mininterval == 0.1  # tqdm's default
    assert console.progress(total=1, file=tty, disable=True).disable
    assert console.progress(total=1, file=log, disable=True).disable



def test_a_disabled_bar_left_open_does_not_make_the_next_bar_nested_in_a_log():
    from tqdm.auto import tqdm

    stream = io.StringIO()
    off = console.progress(total=1, file=stream, disable=True)  # left open on purpose
    assert off.disable
    # a bar switched off after it opened stays in tqdm's instances (tqdm only
    # drops bars disabled at construction): it must not count as open either
    switched = tqdm(total=1, file=io.StringIO(), disable=False)
    switched.disable = True
    try:
        assert switched in tqdm._instances
        bar = console.progress(total=2, file=stream)
        assert not bar.disable  # a top-level bar, not a nested one
        bar.update(2)
        bar.close()
        assert "2/2" in stream.getvalue()
    finally:
        tqdm._instances.discard(switched)


# -- the --verbose flag ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [(["--verbose", "rewards"], "1"), (["rewards"], None)])
def test_verbose_flag_sets_the_variable_before_the_policy_runs(monkeypatch, args, expected):
    from click.testing import CliRunner

    from storyrl import cli

    monkeypatch.delenv("STORYRL_VERBOSE", raising=False)
    seen = []
    monkeypatch.setattr(cli, "configure_output", lambda: seen.append(os.environ.get("STORYRL_VERBOSE")))
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    assert seen == [expected]



@pytest.mark.parametrize("value, quiet", [(None, True), ("", True), ("0", True), ("1", False), ("yes", False)])
def test_storyrl_verbose_zero_is_quiet_like_unset(monkeypatch, value, quiet):
    if value is None:
        monkeypatch.delenv("STORYRL_VERBOSE", raising=False)
    else:
        monkeypatch.setenv("STORYRL_VERBOSE", value)
    assert console.verbose() is not quiet
    monkeypatch.setattr(console, "_configured", True)  # the policy's result without applying it to this process
    assert console.configure_output() is quiet


USER_VERBOSITY = """
import json, logging, os
import huggingface_hub.utils.logging as hub_logging  # imported before the policy: its level is set now
from storyrl.console import configure_output
assert configure_output(False)
from transformers.utils import logging as transformers_logging  # imported after: reads the environment
print(json.dumps({"env": {k: os.environ.get(k) for k in ("TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY",
                                                        "DATASETS_VERBOSITY")},
                  "transformers": transformers_logging.get_verbosity(), "hub": hub_logging.get_verbosity()}))
"""


def test_a_users_own_library_verbosity_survives_the_quiet_policy():
    env = clean_env(TRANSFORMERS_VERBOSITY="info", HF_HUB_VERBOSITY="info")
    proc = subprocess.run([sys.executable, "-c", USER_VERBOSITY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    # the user's settings stay; only the one left unset gets the quiet default
    assert seen["env"] == {"TRANSFORMERS_VERBOSITY": "info", "HF_HUB_VERBOSITY": "info", "DATASETS_VERBOSITY": "error"}
    assert seen["transformers"] == 20 and seen["hub"] == 20  # logging.INFO


# -- a real training command: TRL's dict, transformers' FutureWarning, the fallback warning ------


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """``storyrl train rl`` (1 GRPO step, tiny policy) run with stdout and
    stderr piped, without and with --verbose, both at once."""
    root = tmp_path_factory.mktemp("console")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": TAPM_TEXTS[k], "images": images}) + "\n"
                            for k in range(4)))
    # the d_HM prompt P1 (configs/prompts/dhm.yaml) for 3 images, in the tokenizer's vocabulary
    p1 = "Write a story using exactly three sentences for this image sequence. Do not use more than three sentences."
    policy = save_tiny_llama(root / "llama", [*TAPM_TEXTS, p1])
    procs = {}
    for mode in ("quiet", "verbose"):
        config = root / f"{mode}.yaml"
        config.write_text(json.dumps({
            "algorithm": "grpo", "model": policy, "data": str(data), "output_dir": str(root / mode),
            "rewards": ["rouge_l"], "max_steps": 1, "prompt": "P1",
            # gradient_checkpointing: what makes transformers warn (FutureWarning) at every save
            "grpo": {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8,
                     "logging_steps": 1, "save_strategy": "no", "gradient_checkpointing": True}}))
        flags = ["--verbose"] if mode == "verbose" else []
        procs[mode] = subprocess.Popen([sys.executable, "-m", "storyrl", *flags, "train", "rl", "--config", str(config)],
                                       cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out[mode] = SimpleNamespace(stdout=stdout, stderr=stderr)
    out["fallback"] = "TorchvisionOpsFallbackWarning" in out["verbose"].stderr
    out["root"] = root
    return out


def test_training_without_verbose_prints_the_summary_and_a_plain_bar(rl_run):
    quiet = rl_run["quiet"]
    assert [json.loads(line)["steps"] for line in quiet.stdout.splitlines()] == [1]  # no per-step dict
    assert "'grad_norm'" not in quiet.stderr + quiet.stdout
    assert "FutureWarning" not in quiet.stderr and "TorchvisionOpsFallbackWarning" not in quiet.stderr
    assert "\x1b[A" not in quiet.stderr  # no nested bar moved the cursor in the log
    assert "Loading weights" not in quiet.stderr  # transformers' bars are off in a log
    assert "1/1" in quiet.stderr and "loss=" in quiet.stderr and "reward=" in quiet.stderr


def test_training_with_verbose_prints_what_the_libraries_print(rl_run):
    verbose = rl_run["verbose"]
    assert "'grad_norm'" in verbose.stdout  # TRL's per-step dict, as before
    assert "FutureWarning: `gradient_checkpointing` is deprecated" in verbose.stderr
    assert verbose.stderr.count("TorchvisionOpsFallbackWarning") == (1 if rl_run["fallback"] else 0)
    assert json.loads(verbose.stdout.splitlines()[-1])["steps"] == 1


def test_history_is_the_same_with_and_without_verbose(rl_run):
    rows = {mode: [json.loads(line) for line in (rl_run["root"] / mode / "history.jsonl").read_text().splitlines()]
            for mode in ("quiet", "verbose")}
    assert len(rows["quiet"]) == len(rows["verbose"]) >= 1
    assert set(rows["quiet"][0]) == set(rows["verbose"][0]) and "grad_norm" in rows["quiet"][0]


# -- the logged noise: accelerate's and open_clip's own calls ---------------------------------------


LOGGED = """
import json, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, {tests!r})
import storyrl
from storyrl.console import configure_output
import torch, open_clip
from accelerate import PartialState
from accelerate.utils import clean_state_dict_for_safetensors
from tiny_models import save_tiny_clip

PartialState()
clip = save_tiny_clip(Path({root!r}) / "clip")
empty = Path({root!r}) / "no_weights"
empty.mkdir(exist_ok=True)
(empty / "open_clip_config.json").write_text((Path(clip[len("local-dir:"):]) / "open_clip_config.json").read_text())

def noise():
    shared = torch.zeros(3)
    clean_state_dict_for_safetensors({{"a": shared, "b": shared}})  # "Removed shared tensor"
    open_clip.create_model(clip, pretrained="openai")  # "Ignoring `pretrained='openai'`"
    open_clip.create_model(f"local-dir:{{empty}}", pretrained=None)  # no weights: two warnings
    warnings.warn("a warning of storyrl's own", UserWarning)

noise()
print("=== policy", file=sys.stderr, flush=True)
configure_output({verbose})
noise()
from transformers.utils import logging as transformers_logging
print(json.dumps({{"transformers": transformers_logging.get_verbosity()}}))
"""


def test_logged_noise_is_hidden_and_real_warnings_stay(tmp_path):
    save_tiny_clip(tmp_path / "clip")  # built once here, reused by the children
    procs = {verbose: subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LOGGED.format(tests=str(Path(__file__).parent), root=str(tmp_path),
                                                             verbose=verbose))],
        cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for verbose in (False, True)}  # both at once: each imports torch, open_clip and accelerate
    for verbose, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        before, after = stderr.split("=== policy")
        noise = ["Removed shared tensor", "Ignoring `pretrained='openai'`", "No pretrained weights loaded for model"]
        for message in noise:
            assert message in before  # the library's own call really says it
            assert (message in after) == verbose, (verbose, message)
        # kept either way: the specific warning, and warnings that are not the libraries' noise
        assert "Local config loaded, but no CLIP weights found" in after
        assert "a warning of storyrl's own" in before
        level = json.loads(stdout.splitlines()[-1])["transformers"]
        assert level == (30 if verbose else 40)  # WARNING as transformers sets it, or ERROR


def test_local_clip_is_loaded_without_the_ignored_pretrained_tag(tmp_path, caplog):
    import logging

    from storyrl.models.clip import ClipEmbedder, ClipSpec

    model = save_tiny_clip(tmp_path / "clip")
    with caplog.at_level(logging.INFO):
        embedder = ClipEmbedder(ClipSpec(model, "openai", device="cpu", precision="fp32"))
    assert "Ignoring `pretrained=" not in caplog.text
    assert "Found CLIP weights in local folder" in caplog.text  # its own weights, not a random init
    assert embedder.embed_texts(["a dog ."]).shape == (1, 32)


# -- TRL's progress callback ---------------------------------------------------------------------


def test_quiet_progress_callback_shows_loss_and_reward_not_the_dict(monkeypatch, capsys):
    from storyrl.training.storyteller.rl.trl_trainers import QuietProgressCallback

    stream = TtyStringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    callback = QuietProgressCallback()
    state = SimpleNamespace(is_world_process_zero=True, max_steps=4, global_step=0)
    callback.on_train_begin(None, state, None)
    state.global_step = 2
    callback.on_step_end(None, state, None)
    logs = {"loss": 0.125, "grad_norm": 3.5, "reward": 0.75, **{f"key{k}": k for k in range(40)}}
    callback.on_log(None, state, None, logs=logs)
    callback.on_log(None, state, None, logs={"train_runtime": 1.0})  # the end-of-training summary: no change
    callback.on_train_end(None, state, None)
    text = stream.getvalue()
    assert "2/4" in text and "loss=0.125, reward=0.75" in text
    assert "grad_norm" not in text and "key39" not in text
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("resumed_at", [0, 2])
def test_quiet_progress_callback_ends_at_max_steps_also_after_a_resume(monkeypatch, resumed_at):
    from storyrl.training.storyteller.rl.trl_trainers import QuietProgressCallback

    stream = TtyStringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    callback = QuietProgressCallback()
    # as transformers' Trainer does: the state (global_step = the checkpoint's step on a resume) is
    # loaded before on_train_begin; then on_step_end after each optimizer step, followed by on_log
    state = SimpleNamespace(is_world_process_zero=True, max_steps=5, global_step=resumed_at)
    callback.on_train_begin(None, state, None)
    bar = callback.bar
    seen = []
    for step in range(resumed_at + 1, 6):
        state.global_step = step
        callback.on_step_end(None, state, None)
        callback.on_log(None, state, None, logs={"loss": 0.5, "reward": 0.25})
        seen.append(bar.n)
    callback.on_train_end(None, state, None)
    assert seen == list(range(resumed_at + 1, 6))  # the bar follows global_step, one step at a time
    assert bar.n == 5 and "5/5" in stream.getvalue()


# -- the datasets library's bars, log records' format, the examples' scripts (issue 31 item 13) ----

DATASETS_BARS = ("Map", "Tokenizing", "examples/s", "Truncating", "Filter")


def test_sft_shows_no_datasets_bars_unless_verbose(tmp_path):
    """``storyrl train sft`` (1 step, tiny policy), default, -q and --verbose
    at once: TRL's tokenizing and storyrl's own map are datasets' bars."""
    images = [str(p) for p in write_images(tmp_path / "images", 3)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k:k + 2]),
                                        "images": images}) + "\n" for k in range(4)))
    p1 = "Write a story using exactly three sentences for this image sequence. Do not use more than three sentences."
    policy = save_tiny_llama(tmp_path / "llama", [*TAPM_TEXTS, p1])
    flags = {"default": [], "quiet": ["-q"], "verbose": []}
    procs = {}
    for mode, extra in flags.items():
        config = tmp_path / f"{mode}.yaml"
        config.write_text(json.dumps({"model": policy, "data": str(data), "output_dir": str(tmp_path / mode),
                                      "prompt": "P1", "max_steps": 1, "batch_size": 2, "logging_steps": 1}))
        top = ["--verbose"] if mode == "verbose" else []
        procs[mode] = subprocess.Popen([sys.executable, "-m", "storyrl", *top, "train", "sft", "--config", str(config),
                                        *extra], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    seen = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        assert json.loads(stdout.splitlines()[-1])["steps"] == 1
        seen[mode] = stderr
    assert "Map" in seen["verbose"] and "Tokenizing" in seen["verbose"]  # the bars this run really has
    for mode in ("default", "quiet"):
        assert not [word for word in DATASETS_BARS if word in seen[mode]], seen[mode][-2000:]


LIBRARY_BASIC_CONFIG = """
import logging
from storyrl.console import configure_output
configure_output(VERBOSE)
logging.warning("a library's own root warning")  # what open_clip does; it calls basicConfig without a handler
logging.getLogger("storyrl.rewards.base").warning("bleu: unscorable story (no reference)")
logging.getLogger("storyrl.rewards.base").info("not shown")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_log_records_keep_the_console_format_after_a_library_logs_to_the_root_logger(verbose):
    proc = subprocess.run([sys.executable, "-c", LIBRARY_BASIC_CONFIG.replace("VERBOSE", str(verbose))], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["a library's own root warning", "bleu: unscorable story (no reference)"]


def test_example_make_policy_prints_no_torchvision_fallback_warning(tmp_path):
    """examples/rl/make_policy.py follows storyrl's output policy: the
    fallback warning only with STORYRL_VERBOSE=1 (on a machine that needs the
    fallback; elsewhere there is none either way)."""
    script = ROOT / "examples" / "rl" / "make_policy.py"
    procs = {verbose: subprocess.Popen([sys.executable, str(script), str(tmp_path / str(verbose)), "--steps", "1"],
                                       cwd=ROOT, env=clean_env(**({"STORYRL_VERBOSE": "1"} if verbose else {})),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for verbose in (False, True)}
    seen = {}
    for verbose, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        seen[verbose] = stderr
    # seen[True] shows the warning where torchvision's ops do not load (as on this CPU machine)
    assert "TorchvisionOpsFallbackWarning" not in seen[False], seen[False]
