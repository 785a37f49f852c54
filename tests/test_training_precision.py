"""Precision is part of every trainer's contract (issue 30): the trainers on
:func:`storyrl.training.loop.fit` (RoViST-C, Vrank, RoViST-VG, COSMiC,
TAPM) train at ``mixed_precision`` fp16 and bf16 on the CPU, in that
precision (the autocast dtype each step runs under is recorded), and
their first step's loss is the fp32 run's within a tolerance derived
from the dtype's epsilon; the weights change, stay finite and fp32 (the
master copy autocast keeps), and best/ loads as the reward.

Tolerance: the first step's loss (before any update, same seed and data)
differs from fp32's only by rounding inside the autocast ops; with
``eps`` = the dtype's machine epsilon (fp16 2^-10, bf16 2^-7) it is
allowed ``LOSS_EPS_FACTOR * eps * max(1, |loss|)``. The factor covers
the accumulated rounding of a few layers (each matmul rounds its output
once to the dtype, inputs are rounded once); measured factors are well
under it (see MEASURED below, printed with -s).
"""

from __future__ import annotations

import math

import storyrl  # noqa: F401  (torchvision fallback before transformers/timm)

import pytest
import torch
import tiny_models

from storyrl.training import loop

pytestmark = pytest.mark.usefixtures("one_thread_module")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Allowed first-step loss difference, in units of the dtype's epsilon (module docs).
LOSS_EPS_FACTOR = 8.0
#: Measured |loss - fp32 loss| / (eps * max(1, |loss|)), by trainer and precision (shown with -s).
MEASURED: dict[tuple[str, str], float] = {}


_FIT = loop.fit


def eps(precision: str) -> float:
    return torch.finfo(DTYPES[precision]).eps


class Recorder:
    """``fit`` of a trainer module, wrapped: each training step's loss and the
    autocast dtype it ran under (fp32 when autocast is off) are recorded."""

    def __init__(self, monkeypatch, module) -> None:
        self.losses: list[float] = []
        self.dtypes: set[torch.dtype] = set()
        real = _FIT  # not the module's: an earlier Recorder may have wrapped it

        def fit(model, train, val, config, step_fn, **kwargs):
            def step(m, batch):
                loss, metrics = step_fn(m, batch)
                if m.training:
                    self.losses.append(float(loss.detach().float()))
                    on = torch.is_autocast_enabled("cpu")
                    self.dtypes.add(torch.get_autocast_dtype("cpu") if on else torch.float32)
                return loss, metrics

            return real(model, train, val, config, step, **kwargs)

        monkeypatch.setattr(module, "fit", fit)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def check_run(name: str, precision: str, reference: list[float], rec: Recorder, before: dict, after: dict) -> None:
    """The run at ``precision`` against the fp32 one (module docs)."""
    assert rec.dtypes == {DTYPES[precision]}, rec.dtypes
    first, ref = rec.losses[0], reference[0]
    assert math.isfinite(first)
    diff = abs(first - ref) / (eps(precision) * max(1.0, abs(ref)))
    MEASURED[(name, precision)] = diff
    print(f"{name} {precision}: first loss {first:.6f} vs fp32 {ref:.6f}: {diff:.2f} eps")
    assert diff <= LOSS_EPS_FACTOR, f"{name} {precision}: first loss {first} vs fp32 {ref} ({diff:.1f} eps)"
    assert all(math.isfinite(x) for x in rec.losses)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no weight changed"
    assert all(torch.isfinite(after[k]).all() for k in after)
    # autocast keeps fp32 master weights: what is saved is fp32
    assert {after[k].dtype for k in after} == {torch.float32}


def test_fp16_and_bf16_on_the_cpu_are_those_dtypes_not_fp32(tmp_path):
    """make_accelerator gives what was asked, on the CPU too: fp16 autocast
    with a GradScaler (accelerate alone trains fp16 in fp32 there), bf16
    autocast, no autocast for no; auto = no on the CPU."""
    from storyrl.training.accelerators import make_accelerator, resolve_mixed_precision

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    for asked, dtype, scaled in [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False),
                                 ("no", None, False), ("auto", None, False)]:
        accelerator = make_accelerator(asked)
        with accelerator.autocast():
            seen = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        assert seen == dtype, asked
        assert (accelerator.scaler is not None) == scaled, asked
    assert resolve_mixed_precision("auto", cuda=True) == "fp16"
    assert resolve_mixed_precision("auto", cuda=False) == "no"
    with pytest.raises(ValueError, match="mixed_precision: expected one of auto, no, fp16, bf16, got 'fp8'"):
        resolve_mixed_precision("fp8")


def test_fit_at_fp16_and_bf16_matches_fp32_and_resumes(tmp_path, monkeypatch):
    """The generic loop on a small MLP: every precision's first loss against
    fp32's, weights trained; an fp16 run resumes its GradScaler."""
    from torch.utils.data import TensorDataset

    from storyrl.training.config import TrainConfig

    def data(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        return TensorDataset(x, (x.sum(-1) > 0).long())

    def step(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    def run(precision, out, resume=False, **extra):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        before = weights(model)
        rec = Recorder(monkeypatch, loop)
        config = TrainConfig(output_dir=str(out), epochs=2, batch_size=8, lr=0.01, mixed_precision=precision,
                             **extra)
        loop.fit(model, data(32, 0), data(8, 1), config, step, progress=False, resume=resume)
        return rec, before, weights(model)

    reference = run("no", tmp_path / "fp32")[0].losses
    for precision in DTYPES:
        check_run("fit", precision, reference, *run(precision, tmp_path / precision))
    # fp16 resume: the GradScaler's scale is restored with the checkpoint.
    whole, _, w_whole = run("fp16", tmp_path / "whole")
    run("fp16", tmp_path / "cut", max_steps=5)
    resumed, _, w_resumed = run("fp16", tmp_path / "cut", resume=True)
    assert resumed.losses == whole.losses[5:]  # its own steps, as the uninterrupted run took them
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)
