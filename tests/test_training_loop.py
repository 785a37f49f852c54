"""The generic training loop (storyrl.training.loop.fit) on toy models."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import storyrl  # noqa: F401  (before torch/accelerate: CPU torchvision fallback)

import pytest
import torch
from torch.utils.data import TensorDataset

from storyrl.training import checkpoints
from storyrl.training.config import TrainConfig
from storyrl.training.loop import FitResult, fit


# Tiny models train faster on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def blobs(n: int, seed: int, flip: bool = False) -> TensorDataset:
    """Two separable Gaussian blobs in 2-D; ``flip`` swaps the labels."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 2, generator=g) * 0.5 + (y.float() * 2 - 1).unsqueeze(1) * torch.tensor([1.5, -1.0])
    return TensorDataset(x, 1 - y if flip else y)


def classify_step(model, batch):
    x, y = batch
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss, {"correct": int((logits.argmax(-1) == y).sum()), "n": len(y)}


def make_model(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 2)
    )


def config(tmp_path, **kw) -> TrainConfig:
    base = dict(output_dir=str(tmp_path / "run"), epochs=4, batch_size=16, lr=0.02, patience=10, log_every=2)
    base.update(kw)
    return TrainConfig(**base)


def read_history(cfg: TrainConfig) -> list[dict]:
    with open(f"{cfg.output_dir}/history.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_fit_trains_logs_and_saves_best(tmp_path):
    cfg = config(tmp_path, epochs=5)
    model = make_model()
    result = fit(model, blobs(128, 1), blobs(48, 2), cfg, classify_step, progress=False)
    assert isinstance(result, FitResult)
    assert result.epochs_run == 5 and not result.stopped_early

    history = read_history(cfg)
    assert history == result.history
    assert [r["epoch"] for r in history] == [1, 2, 3, 4, 5]
    for r in history:
        assert {"train_loss", "val_loss", "train_acc", "val_acc", "lr", "seconds"} <= set(r)
        assert 0.0 <= r["train_acc"] <= 1.0 and 0.0 <= r["val_acc"] <= 1.0
        assert "train_correct" not in r  # consumed by the acc
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_acc"] > 0.9
    # lr decays x0.95 per epoch
    for a, b in zip(history, history[1:]):
        assert b["lr"] == pytest.approx(a["lr"] * 0.95)
    assert history[0]["lr"] == pytest.approx(0.02)

    best_epoch = min(history, key=lambda r: r["val_loss"])["epoch"]
    assert result.best_epoch == best_epoch
    assert result.best_val_loss == pytest.approx(history[best_epoch - 1]["val_loss"])
    saved = torch.load(f"{cfg.output_dir}/best/model.pt", weights_only=True)
    if best_epoch == 5:
        for k, v in model.state_dict().items():
            assert torch.equal(saved[k].cpu(), v.cpu())
    assert (tmp_path / "run" / "last" / "trainer_state.json").is_file()


def test_val_acc_matches_direct_evaluation(tmp_path):
    cfg = config(tmp_path, epochs=1, batch_size=5)  # uneven last batch
    val = blobs(23, 2)
    model = make_model()
    result = fit(model, blobs(64, 1), val, cfg, classify_step, progress=False)
    model.eval()
    with torch.no_grad():
        x, y = val.tensors
        logits = model(x)
        acc = float((logits.argmax(-1) == y).float().mean())
        loss = float(torch.nn.functional.cross_entropy(logits, y))
    assert result.history[0]["val_acc"] == pytest.approx(acc)
    assert result.history[0]["val_loss"] == pytest.approx(loss, rel=1e-5)


def test_early_stopping(tmp_path):
    # Validation labels are flipped: learning the training set makes the
    # validation loss rise from the first epoch on.
    cfg = config(tmp_path, epochs=10, patience=1, lr=0.05)
    saves = []

    def save(model, path):
        saves.append(path)

    result = fit(make_model(), blobs(128, 1), blobs(48, 2, flip=True), cfg, classify_step, save_fn=save, progress=False)
    assert result.stopped_early
    assert result.epochs_run == 2 and result.best_epoch == 1
    assert len(read_history(cfg)) == 2
    # save_fn writes aside; best.tmp is swapped in as best/ when it exists.
    assert saves == [tmp_path / "run" / "best.tmp"]


def test_max_steps(tmp_path):
    # 64 / 8 = 8 batches an epoch: step 3 is inside epoch 1.
    cfg = config(tmp_path, epochs=3, batch_size=8, max_steps=3)
    result = fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    assert result.epochs_run == 0 and result.best_epoch == 0  # no epoch completed
    (record,) = read_history(cfg)
    assert record["step"] == 3 and record["epoch"] == 1 and record["partial"] is True
    assert math.isfinite(record["val_loss"])  # validated all the same
    assert result.history == [record]
    assert (tmp_path / "run" / "last" / "trainer_state.json").is_file()
    assert not (tmp_path / "run" / "best").exists()  # best/ is for complete epochs

    # A stop on an epoch's last batch completes the epoch.
    cfg = config(tmp_path / "whole", epochs=3, batch_size=8, max_steps=8)
    result = fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    assert result.epochs_run == 1 and result.best_epoch == 1
    (record,) = read_history(cfg)
    assert record["step"] == 8 and "partial" not in record
    assert (tmp_path / "whole" / "run" / "best" / "model.pt").is_file()


def test_resume_matches_uninterrupted_run(tmp_path):
    train, val = blobs(96, 1), blobs(32, 2)
    straight = make_model(dropout=0.3)  # dropout: RNG state must line up too
    cfg_a = config(tmp_path / "a", epochs=4)
    fit(straight, train, val, cfg_a, classify_step, progress=False)

    cfg_b = config(tmp_path / "b", epochs=2)
    first = fit(make_model(dropout=0.3), train, val, cfg_b, classify_step, progress=False)
    assert first.epochs_run == 2
    # A differently initialised model: everything must come from the checkpoint.
    resumed_model = make_model(seed=123, dropout=0.3)
    cfg_b4 = config(tmp_path / "b", epochs=4)
    resumed = fit(resumed_model, train, val, cfg_b4, classify_step, resume=True, progress=False)

    assert resumed.epochs_run == 4
    assert [r["epoch"] for r in read_history(cfg_b4)] == [1, 2, 3, 4]
    a_hist, b_hist = read_history(cfg_a), read_history(cfg_b4)
    for ra, rb in zip(a_hist, b_hist):
        assert rb["train_loss"] == pytest.approx(ra["train_loss"], rel=1e-6)
        assert rb["val_loss"] == pytest.approx(ra["val_loss"], rel=1e-6)
        assert rb["lr"] == pytest.approx(ra["lr"])
    sa, sb = straight.state_dict(), resumed_model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=1e-6), k

    # Resuming a finished run trains nothing more.
    again = fit(make_model(seed=5, dropout=0.3), train, val, cfg_b4, classify_step, resume=True, progress=False)
    assert again.epochs_run == 4 and len(again.history) == 4


def without_seconds(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in history]


def assert_same_weights(a: torch.nn.Module | dict, b: torch.nn.Module | dict) -> None:
    sa = a if isinstance(a, dict) else a.state_dict()
    sb = b if isinstance(b, dict) else b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def best_weights(cfg: TrainConfig) -> dict:
    return torch.load(f"{cfg.output_dir}/best/model.pt", weights_only=True)


def test_resume_after_max_steps_mid_epoch_matches_uninterrupted_run(tmp_path):
    # 96 / 16 = 6 batches an epoch. The stops: inside epoch 1, at the end of
    # epoch 1, inside epoch 2 (twice), then to the end.
    train, val = blobs(96, 1), blobs(32, 2)
    straight = make_model(dropout=0.3)  # dropout: the RNG must line up too
    cfg_a = config(tmp_path / "a", epochs=3)
    fit(straight, train, val, cfg_a, classify_step, progress=False)
    expected = without_seconds(read_history(cfg_a))

    cfg = config(tmp_path / "b", epochs=3, max_steps=4)
    first = fit(make_model(dropout=0.3), train, val, cfg, classify_step, progress=False)
    assert first.epochs_run == 0
    (partial,) = read_history(cfg)
    assert (partial["epoch"], partial["step"], partial["partial"]) == (1, 4, True)
    assert partial["lr"] == expected[0]["lr"]

    for i, max_steps in enumerate([6, 8, 11, None]):
        # A differently initialised model: everything must come from the checkpoint.
        model = make_model(seed=100 + i, dropout=0.3)
        cfg = config(tmp_path / "b", epochs=3, max_steps=max_steps)
        result = fit(model, train, val, cfg, classify_step, resume=True, progress=False)
        history = read_history(cfg)
        assert history == result.history
        done = [r for r in history if not r.get("partial")]
        assert without_seconds(done) == expected[: len(done)]
        assert result.epochs_run == len(done)
        if max_steps in (8, 11):
            assert history[-1]["partial"] is True and history[-1]["step"] == max_steps
        else:
            assert "partial" not in history[-1]
    assert [r["step"] for r in history] == [6, 12, 18]
    assert without_seconds(history) == expected
    assert_same_weights(straight, model)
    assert_same_weights(best_weights(cfg_a), best_weights(cfg))


class Crash(Exception):
    """A simulated kill at one point of the loop's file operations."""


def crash_on_rename(monkeypatch, src_name: str, nth: int) -> None:
    """Make the loop's ``nth`` os.replace of a path named ``src_name`` fail."""
    calls = []

    class FakeOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def replace(src, dst):
            if Path(src).name == src_name:
                calls.append(src)
                if len(calls) == nth:
                    raise Crash(f"killed renaming {src} -> {dst}")
            os.replace(src, dst)

    monkeypatch.setattr(checkpoints, "os", FakeOs())


def test_resume_falls_back_to_last_old_and_rewrites_history(tmp_path, monkeypatch):
    train, val = blobs(96, 1), blobs(32, 2)
    straight = make_model(dropout=0.3)
    cfg_a = config(tmp_path / "a", epochs=4)
    fit(straight, train, val, cfg_a, classify_step, progress=False)

    # Killed while swapping in epoch 3's checkpoint: last/ is already last.old,
    # last.tmp not yet last/. history.jsonl has epoch 3, the checkpoint has not.
    cfg = config(tmp_path / "b", epochs=4)
    run = tmp_path / "b" / "run"
    crash_on_rename(monkeypatch, "last.tmp", nth=3)
    with pytest.raises(Crash):
        fit(make_model(dropout=0.3), train, val, cfg, classify_step, progress=False)
    monkeypatch.undo()
    assert not (run / "last").exists() and (run / "last.old" / "trainer_state.json").is_file()
    assert [r["epoch"] for r in read_history(cfg)] == [1, 2, 3]

    model = make_model(seed=7, dropout=0.3)
    result = fit(model, train, val, cfg, classify_step, resume=True, progress=False)
    assert result.epochs_run == 4
    # Epoch 3 was trained again from last.old, its record rewritten (not repeated).
    assert [r["epoch"] for r in read_history(cfg)] == [1, 2, 3, 4]
    assert without_seconds(read_history(cfg)) == without_seconds(read_history(cfg_a))
    assert_same_weights(straight, model)
    assert (run / "last").is_dir() and not (run / "last.old").exists() and not (run / "last.tmp").exists()



def test_resume_restores_best_old(tmp_path, monkeypatch):
    train, val = blobs(96, 1), blobs(32, 2)
    straight = make_model(dropout=0.3)
    cfg_a = config(tmp_path / "a", epochs=3)
    fit(straight, train, val, cfg_a, classify_step, progress=False)
    cfg_1 = config(tmp_path / "one", epochs=1)
    fit(make_model(dropout=0.3), train, val, cfg_1, classify_step, progress=False)

    # Killed while replacing best/ by epoch 2's (epoch 1's save had no best/
    # to replace, so its rename of best.tmp is the first).
    cfg = config(tmp_path / "b", epochs=3)
    run = tmp_path / "b" / "run"
    crash_on_rename(monkeypatch, "best.tmp", nth=2)
    with pytest.raises(Crash):
        fit(make_model(dropout=0.3), train, val, cfg, classify_step, progress=False)
    monkeypatch.undo()
    assert not (run / "best").exists() and (run / "best.old").is_dir() and (run / "best.tmp").is_dir()

    # Resuming where there is nothing left to train (the checkpoint is epoch 1's)
    # puts best.old back: the best/ that goes with the checkpoint.
    done = fit(make_model(seed=3), train, val, config(tmp_path / "b", epochs=1), classify_step,
               resume=True, progress=False)
    assert done.epochs_run == 1 and done.best_epoch == 1
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("best")) == ["best"]
    assert_same_weights(best_weights(cfg_1), best_weights(cfg))
    assert without_seconds(read_history(cfg)) == without_seconds(read_history(cfg_1))

    model = make_model(seed=4, dropout=0.3)
    fit(model, train, val, cfg, classify_step, resume=True, progress=False)
    assert without_seconds(read_history(cfg)) == without_seconds(read_history(cfg_a))
    assert_same_weights(straight, model)
    assert_same_weights(best_weights(cfg_a), best_weights(cfg))


def test_failed_save_keeps_previous_best(tmp_path):
    cfg = config(tmp_path, epochs=2)
    calls = []

    def save(model, directory):
        calls.append(directory)
        directory.mkdir(parents=True)
        (directory / "model.pt").write_bytes(b"half")  # written, then killed
        if len(calls) == 2:
            raise Crash("killed in save_fn")
        torch.save(model.state_dict(), directory / "model.pt")

    with pytest.raises(Crash):
        fit(make_model(), blobs(96, 1), blobs(32, 2), cfg, classify_step, save_fn=save, progress=False)
    assert len(calls) == 2  # epoch 2 improved too
    model = make_model()
    fit(model, blobs(96, 1), blobs(32, 2), config(tmp_path / "one", epochs=1), classify_step, progress=False)
    assert (tmp_path / "run" / "best" / "model.pt").read_bytes() != b"half"
    assert_same_weights(model, best_weights(cfg))  # epoch 1's best/, whole


def test_mixed_precision_bf16_on_cpu(tmp_path):
    # Also checks that fit can run again in a process whose accelerate state
    # was initialised with another mixed_precision.
    cfg = config(tmp_path, epochs=2, mixed_precision="bf16")
    result = fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    assert result.epochs_run == 2 and all(math.isfinite(r["val_loss"]) for r in result.history)
    result = fit(make_model(), blobs(64, 1), blobs(16, 2), config(tmp_path / "fp32", epochs=1), classify_step)
    assert result.epochs_run == 1


def test_mixed_precision_fp16_runs_fp16_autocast_with_loss_scaling(tmp_path):
    """fp16 is never turned into fp32 (accelerate alone would on the CPU): the
    steps run under fp16 autocast and the loss is scaled (the GradScaler's
    state is in the checkpoint). Closeness to fp32: test_training_precision.py."""
    seen = []

    def step(model, batch):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return classify_step(model, batch)

    cfg = config(tmp_path, epochs=1, mixed_precision="fp16")
    result = fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, step, progress=False)
    assert result.epochs_run == 1 and math.isfinite(result.history[0]["val_loss"])
    if not torch.cuda.is_available():
        assert seen and set(seen) == {torch.float16}
        assert (Path(cfg.output_dir) / "last" / "scaler.pt").is_file()


def test_resume_without_checkpoint_starts_afresh_and_says_so(tmp_path, caplog):
    """A run killed before its first checkpoint may have left best/ (saved
    before the checkpoint): --resume starts the run from the beginning,
    drops that best/, and trains as a fresh run does."""
    fresh = fit(make_model(), blobs(16, 1), blobs(8, 2), config(tmp_path / "a"), classify_step, progress=False)
    cfg = config(tmp_path / "b")
    stale = Path(cfg.output_dir) / "best"
    stale.mkdir(parents=True)
    (stale / "model.pt").write_text("from the killed run")
    with caplog.at_level(logging.WARNING, logger="storyrl.training.loop"):
        resumed = fit(make_model(), blobs(16, 1), blobs(8, 2), cfg, classify_step, resume=True, progress=False)
    assert "no checkpoint" in caplog.text and "starting from the beginning" in caplog.text
    assert [h["val_loss"] for h in resumed.history] == [h["val_loss"] for h in fresh.history]
    assert (stale / "model.pt").read_bytes() != b"from the killed run"


def test_empty_validation_set(tmp_path):
    with pytest.raises(ValueError, match="validation set is empty"):
        fit(make_model(), blobs(16, 1), blobs(0, 2), config(tmp_path), classify_step, progress=False)


# ---------------------------------------------------------------------------
# TrainConfig.from_yaml
# ---------------------------------------------------------------------------


@dataclass
class _SubConfig(TrainConfig):
    stories: list[str] | None = None
    mode: str = "prefix"
    options: dict[str, float] = field(default_factory=dict)


def write(tmp_path, text: str):
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_from_yaml_reads_values_and_overrides(tmp_path):
    path = write(tmp_path, "output_dir: out/x\nepochs: 3\nlr: 1e-5\nweight_decay: 0\nmax_steps: null\n")
    cfg = TrainConfig.from_yaml(path, epochs=None, batch_size=8)
    assert cfg.epochs == 3 and cfg.batch_size == 8  # None override ignored
    assert cfg.lr == 1e-5 and isinstance(cfg.lr, float)  # PyYAML reads `1e-5` as a string
    assert cfg.weight_decay == 0.0 and cfg.max_steps is None
    assert TrainConfig(**cfg.to_dict()) == cfg

    sub = _SubConfig.from_yaml(write(tmp_path, "output_dir: o\nstories: [a.json, b.jsonl]\nmode: adjacent\n"))
    assert sub.stories == ["a.json", "b.jsonl"] and sub.mode == "adjacent" and sub.patience == 5
    sub = _SubConfig.from_yaml(write(tmp_path, "output_dir: o\noptions: {drop: 1}\n"))
    assert sub.options == {"drop": 1.0}
    with pytest.raises(ValueError, match="'options': expected a mapping"):
        _SubConfig.from_yaml(write(tmp_path, "output_dir: o\noptions: [1]\n"))


def test_from_yaml_unknown_key(tmp_path):
    path = write(tmp_path, "output_dir: o\nepoch: 3\n")
    with pytest.raises(ValueError) as info:
        TrainConfig.from_yaml(path)
    message = str(info.value)
    assert str(path) in message and "'epoch'" in message and "epochs" in message  # lists valid keys
    with pytest.raises(ValueError, match="stories"):
        TrainConfig.from_yaml(write(tmp_path, "output_dir: o\nstories: [a]\n"))
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        TrainConfig.from_yaml(write(tmp_path, "output_dir: o\n"), bogus=1)


@pytest.mark.parametrize(
    "line, key",
    [
        ("epochs: ten", "epochs"),
        ("epochs: 2.5", "epochs"),
        ("lr: fast", "lr"),
        ("mixed_precision: 16", "mixed_precision"),
    ],
)
def test_from_yaml_wrong_type(tmp_path, line, key):
    path = write(tmp_path, f"output_dir: o\n{line}\n")
    with pytest.raises(ValueError) as info:
        TrainConfig.from_yaml(path)
    assert str(path) in str(info.value) and repr(key) in str(info.value)


def test_from_yaml_wrong_list_items_and_missing_required(tmp_path):
    with pytest.raises(ValueError, match="'stories'"):
        _SubConfig.from_yaml(write(tmp_path, "output_dir: o\nstories: a.json\n"))
    path = write(tmp_path, "epochs: 2\n")
    with pytest.raises(ValueError, match="output_dir"):
        TrainConfig.from_yaml(path)
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig.from_yaml(write(tmp_path, "output_dir: o\nmixed_precision: fp8\n"))


def test_warmup_scales_each_step_and_keeps_the_scheduled_rate():
    """Hand computation with plain SGD (gradient 1): step k of a 4-step
    warm-up moves the weight by lr * (k + 1) / 4, then by lr."""
    import torch

    from storyrl.training.loop import _step_with_warmup

    weight = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    moves = []
    for step in range(6):
        weight.grad = torch.ones(())
        before = float(weight)
        _step_with_warmup(optimizer, step, warmup_steps=4)
        moves.append(before - float(weight))
        assert optimizer.param_groups[0]["lr"] == 0.5  # the schedule's rate is left as it was
    assert moves == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])


def test_adamw_is_chosen_by_the_config():
    from storyrl.training.config import TrainConfig

    assert TrainConfig(output_dir="x").optimizer == "adam"  # RoViST's default stays
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(output_dir="x", optimizer="sgd")


# -- resume of a finished run; checkpoints that are not this run's (issue 31, items 5, 6, 8) -----------------


def files_of(directory: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("extra", [{}, {"max_steps": 3}], ids=["epochs", "mid-epoch max_steps"])
def test_a_finished_run_resumed_changes_no_file(tmp_path, extra):
    cfg = config(tmp_path, epochs=2, **extra)
    first = fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    before = files_of(Path(cfg.output_dir))
    again = fit(make_model(seed=9), blobs(64, 1), blobs(16, 2), cfg, classify_step, resume=True, progress=False)
    assert again.summary() == first.summary()
    assert files_of(Path(cfg.output_dir)) == before


def test_a_checkpoint_past_max_steps_is_refused(tmp_path):
    cfg = config(tmp_path, epochs=2, max_steps=6)
    fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    last = Path(cfg.output_dir) / "last"
    with pytest.raises(ValueError, match=f"^{last}: at step 6, past this run's max_steps 5; resume with max_steps "
                                         ">= 6"):
        fit(make_model(), blobs(64, 1), blobs(16, 2), config(tmp_path, epochs=2, max_steps=5), classify_step,
            resume=True, progress=False)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_an_unreadable_checkpoint_file_is_named(tmp_path, name):
    cfg = config(tmp_path, epochs=1)
    fit(make_model(), blobs(64, 1), blobs(16, 2), cfg, classify_step, progress=False)
    path = Path(cfg.output_dir) / "last" / name
    assert path.is_file()
    path.write_bytes(b"\x80\x04junk" * 3)
    with pytest.raises(ValueError, match=f"^{path}: "):
        fit(make_model(), blobs(64, 1), blobs(16, 2), config(tmp_path, epochs=2), classify_step, resume=True,
            progress=False)
