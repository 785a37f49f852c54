"""A small, generic supervised training loop for the learned metrics.

Both RoViST-C (sentence-order prediction) and RoViST-VG train a model with
Adam + an exponential per-epoch lr decay + early stopping on validation loss
(RoViST paper, App. B). :func:`fit` does that with accelerate, so the same code
runs on CPU, one GPU, or several GPUs under ``accelerate launch``.

Output directory layout::

    history.jsonl   one JSON record per epoch (the last one marked
                    ``"partial": true`` when max_steps stopped inside an epoch)
    best/           save_fn's output for the epoch with the lowest val loss
                    (or the best ``monitor`` value, e.g. highest val_acc)
    last/           accelerate checkpoint + trainer_state.json (resume)
    last.old/, best.old/   the previous version, present only when a crash
                    interrupted its replacement; resume falls back to them

These files are written and read by :mod:`storyrl.training.checkpoints`.

A ``max_steps`` stop inside an epoch checkpoints the position in that epoch
(batches done, the epoch's running train totals, the RNG state after the last
step); resume finishes the epoch from there, so an interrupted and resumed run
trains on the same batches, in the same order, as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from storyrl.training.accelerators import make_accelerator
from storyrl.training.checkpoints import (
    TRAINER_STATE,
    find_checkpoint,
    load_checkpoint,
    restore_best,
    rng_state,
    save_best,
    save_checkpoint,
    set_rng_state,
    write_history,
)
from storyrl.training.config import TrainConfig
from storyrl.training.guards import check_finite_loss, check_resume_step

__all__ = ["FitResult", "fit", "StepFn", "SaveFn", "TRAINER_STATE"]

logger = logging.getLogger(__name__)

StepFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, Mapping[str, float]]"]
SaveFn = Callable[[torch.nn.Module, Path], None]


@dataclass
class FitResult:
    best_epoch: int  # 1-based; 0 when no epoch produced a finite monitored value
    best_val_loss: float  # the best epoch's validation loss
    epochs_run: int  # epochs completed in total, including those before a resume
    stopped_early: bool
    history: list[dict] = field(default_factory=list)
    monitor: str = "val_loss"  # the history key that chose best/ and early stopping
    best_metric: float = math.nan  # its value at the best epoch
    output_dir: str = ""

    def summary(self) -> dict[str, Any]:
        """The ``storyrl train`` JSON line: the best epoch and how the run ended."""
        return {
            "output_dir": self.output_dir,
            "best_epoch": self.best_epoch,
            "best_val_loss": self.best_val_loss,
            # What chose best/ when it is not the validation loss (Vrank: val_acc).
            **({self.monitor: self.best_metric} if self.monitor != "val_loss" else {}),
            "epochs_run": self.epochs_run,
            "stopped_early": self.stopped_early,
        }


class _EpochShuffleSampler(Sampler[int]):
    """A permutation drawn from a generator seeded with ``seed + epoch``: the
    order of every epoch is fixed by the config alone, so a resumed run sees
    the same batches as an uninterrupted one (and all processes agree)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        # Not named `generator`: accelerate would try to synchronise it.
        self._gen = torch.Generator()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self._gen.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=self._gen).tolist())

    def __len__(self) -> int:
        return self.n


class _CountingCollate:
    """Collate that also returns the number of examples, so epoch losses are
    exact per-example means whatever the batch structure is. A class (not a
    closure) so DataLoader workers can pickle it."""

    def __init__(self, collate_fn: Callable | None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list) -> tuple[int, Any]:
        if self.collate_fn is None:
            from torch.utils.data import default_collate

            return len(items), default_collate(items)
        return len(items), self.collate_fn(items)


def _default_save(model: torch.nn.Module, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / "model.pt")


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().sum().item())
    return float(value)


class _Totals:
    """Sums of (loss * n), n and the step_fn metrics over one epoch."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.n = 0
        self.metrics: dict[str, float] = {}

    @classmethod
    def restore(cls, saved: Mapping[str, Any]) -> "_Totals":
        totals = cls()
        totals.loss, totals.n, totals.metrics = saved["loss"], int(saved["n"]), dict(saved["metrics"])
        return totals

    def add(self, loss: torch.Tensor, n: int, metrics: Mapping[str, Any]) -> None:
        self.loss += float(loss.detach().float().item()) * n
        self.n += n
        for key, value in (metrics or {}).items():
            self.metrics[key] = self.metrics.get(key, 0.0) + _to_float(value)

    def reduce(self, accelerator, keys: list[str]) -> tuple[float, float, dict[str, float]]:
        """Sum over processes. ``keys`` (all metric names, same order on every
        process) keeps the collective shapes identical even if a process saw
        no batch."""
        values = [self.loss, float(self.n)] + [self.metrics.get(k, 0.0) for k in keys]
        t = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            t = accelerator.reduce(t, reduction="sum")
        loss, n, *rest = t.tolist()
        return loss, n, dict(zip(keys, rest))


def _summarise(prefix: str, loss_sum: float, n: float, metrics: dict[str, float]) -> dict[str, float]:
    """``{prefix}_loss`` (per-example mean), ``{prefix}_acc`` for every
    ``correct``/``n`` pair (also ``x_correct``/``x_n`` → ``x_acc``), and the
    other metric sums as they are."""
    out = {f"{prefix}_loss": loss_sum / n if n else math.nan}
    used: set[str] = set()
    for key in sorted(metrics):
        stem = key[: -len("correct")] if key.endswith("correct") else None
        if stem is None or (stem and not stem.endswith("_")):
            continue
        n_key = f"{stem}n"
        if n_key in metrics:
            denom = metrics[n_key]
            out[f"{prefix}_{stem}acc"] = metrics[key] / denom if denom else math.nan
            used |= {key, n_key}
    for key, value in metrics.items():
        if key not in used:
            out[f"{prefix}_{key}"] = value
    return out


def _metric_keys(accelerator, local: Mapping[str, float]) -> list[str]:
    """The union of metric names over processes, in one order."""
    keys = set(local)
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        for part in gather_object([sorted(keys)]):
            keys |= set(part)
    return sorted(keys)


def fit(
    model: torch.nn.Module,
    train_dataset: Dataset,
    val_dataset: Dataset,
    config: TrainConfig,
    step_fn: StepFn,
    *,
    collate_fn: Callable | None = None,
    save_fn: SaveFn | None = None,
    resume: bool = False,
    progress: bool = True,
    monitor: str = "val_loss",
    maximize: bool = False,
) -> FitResult:
    """Train ``model`` on ``train_dataset``, validating on ``val_dataset`` after
    every epoch.

    ``step_fn(model, batch) -> (loss, metrics)`` is called with the model in
    train mode (gradients on) and in eval mode under ``torch.no_grad()``;
    ``loss`` is the batch mean, ``metrics`` (e.g. ``{"correct": k, "n": m}``)
    are summed over the epoch. ``save_fn(unwrapped_model, directory)`` runs
    (main process) whenever the validation loss of a complete epoch improves;
    ``directory`` is ``output_dir/best.tmp``, which then replaces ``best/``
    (so ``best/`` is never half-written); by default it writes ``model.pt``
    (a state dict).
    ``resume=True`` continues from ``output_dir/last``: at the next epoch, or,
    after a ``max_steps`` stop inside an epoch, at the next batch of that epoch.
    A validation at such a stop is only reported (a ``"partial"`` history
    record, replaced once the epoch completes): it does not touch ``best/``,
    the lr schedule or early stopping, and ``epochs_run`` counts complete
    epochs only.

    ``monitor`` names the epoch-record value that picks ``best/`` and drives
    early stopping (default the validation loss, lower is better), e.g.
    ``"val_acc"`` with ``maximize=True``; a NaN or missing value never
    improves.
    """
    from accelerate.utils import send_to_device, set_seed

    from storyrl.console import progress as progress_bar

    if len(train_dataset) == 0:
        raise ValueError("fit: the training set is empty")
    if len(val_dataset) == 0:
        raise ValueError("fit: the validation set is empty (early stopping needs a validation loss)")
    save_fn = save_fn or _default_save
    output_dir = Path(config.output_dir)

    accelerator = make_accelerator(config.mixed_precision)
    main = accelerator.is_main_process
    show = progress and accelerator.is_local_main_process

    checkpoint = None
    if resume:
        checkpoint = find_checkpoint(output_dir)
        if checkpoint is None:
            # Killed before its first checkpoint: nothing to continue (as train rl does).
            logger.warning("resume: no checkpoint in %s (expected %s); starting from the beginning", output_dir,
                           output_dir / "last" / TRAINER_STATE)
            if main:  # what the killed run left before it: a best/ of an epoch that starts again
                for stale in ("best", "best.old", "best.tmp", "last.tmp", "last.old"):
                    shutil.rmtree(output_dir / stale, ignore_errors=True)
    elif main and (output_dir / "last").exists():
        logger.warning("%s already holds a checkpoint; starting afresh and overwriting it", output_dir)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        if checkpoint is not None:
            restore_best(output_dir)

    set_seed(config.seed)
    collate = _CountingCollate(collate_fn)
    sampler = _EpochShuffleSampler(len(train_dataset), config.seed)
    train_loader = DataLoader(
        train_dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=config.num_workers,
    )
    # Validation is sharded by hand (no padding) rather than through
    # accelerate's loader, whose even_batches padding would count duplicated
    # examples in the validation loss on several processes.
    val_shard = Subset(val_dataset, range(accelerator.process_index, len(val_dataset), accelerator.num_processes))
    val_loader = DataLoader(
        val_shard, batch_size=config.batch_size, shuffle=False, collate_fn=collate, num_workers=config.num_workers
    )

    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    optimizer = optimizer_class(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay
    )
    # Not passed to prepare(): accelerate's scheduler wrapper steps once per
    # process per call (meant for per-step schedules); this one is per epoch.
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=config.lr_decay)
    # The schedule's state is saved in trainer_state.json (JSON), not as
    # accelerate's custom_checkpoint_*.pkl, which resume would unpickle.
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)

    history: list[dict] = []
    epoch_done = 0
    global_step = 0
    sign = -1.0 if maximize else 1.0  # the monitored value, as something to minimise
    best_val = math.inf  # sign * best monitored value
    best_loss = math.nan  # the best epoch's val loss
    best_epoch = 0
    bad_epochs = 0
    stopped_early = False
    # Where a max_steps stop left the epoch after epoch_done (0: at its start).
    resume_batches = 0
    resume_totals = _Totals()
    resume_seconds = 0.0
    resume_rng: dict[str, Any] | None = None
    if checkpoint is not None:
        state = load_checkpoint(accelerator, checkpoint, config.to_dict())
        scheduler.load_state_dict(state["scheduler"])
        history = state["history"]
        epoch_done, global_step = state["epoch"], state["global_step"]
        check_resume_step(checkpoint, global_step, config.max_steps)  # past max_steps: not this run's
        # Older checkpoints, and val_loss runs, keep only best_val_loss.
        best_value = state.get("best_metric", state["best_val_loss"])
        best_val = sign * best_value if best_value is not None else math.inf
        best_loss = state["best_val_loss"] if state["best_val_loss"] is not None else math.nan
        best_epoch, bad_epochs = state["best_epoch"], state["bad_epochs"]
        # A larger patience on resume lets an early-stopped run go on.
        stopped_early = state["stopped_early"] and bad_epochs >= config.patience
        partial = state.get("partial_epoch")  # absent from older checkpoints
        if partial:
            resume_batches, resume_seconds = partial["batches"], partial["seconds"]
            # Saved summed over processes: process 0 carries the sums (the
            # epoch's totals are summed over processes again at its end).
            if accelerator.process_index == 0:
                resume_totals = _Totals.restore(partial["train"])
            # load_state has just restored the RNG as it was after the last
            # step; kept for when the skipped batches have been drawn.
            resume_rng = rng_state()
        logger.info(
            "resuming from %s after epoch %d%s (step %d)",
            checkpoint,
            epoch_done,
            f" and {resume_batches} batches of epoch {epoch_done + 1}" if resume_batches else "",
            global_step,
        )
    history_path = output_dir / "history.jsonl"
    if main:
        # Rewritten from the checkpoint: drops records of epochs after it.
        write_history(history_path, history)

    def finished() -> bool:
        return (
            stopped_early
            or epoch_done >= config.epochs
            or (config.max_steps is not None and global_step >= config.max_steps)
        )

    epoch_bar = progress_bar(total=config.epochs, initial=epoch_done, desc="epochs", disable=not show, position=0)
    while not finished():
        epoch = epoch_done + 1
        skip, resume_batches = resume_batches, 0
        started = time.perf_counter() - (resume_seconds if skip else 0.0)
        # Per-epoch seeds make dropout etc. independent of where a run resumed.
        set_seed(config.seed + epoch, device_specific=True)
        # Through the prepared loader: accelerate's loader re-sets its
        # sampler's epoch from its own iteration counter on every __iter__.
        (train_loader if hasattr(train_loader, "set_epoch") else sampler).set_epoch(epoch)
        lr = optimizer.param_groups[0]["lr"]

        model.train()
        train_totals = resume_totals if skip else _Totals()
        running, running_n = 0.0, 0
        batches = iter(train_loader)
        if skip:
            # Continue the interrupted epoch: the same permutation (epoch-seeded
            # sampler) and loader seed (drawn at iter() after set_seed); the
            # batches already trained on are drawn (so workers advance as they
            # did) and dropped, then the RNG goes back to its state after the
            # last step.
            for _ in itertools.islice(batches, skip):
                pass
            set_rng_state(resume_rng)
        epoch_batches = skip
        hit_max_steps = False
        bar = progress_bar(batches, total=len(train_loader), initial=skip, desc=f"epoch {epoch}", leave=False,
                           disable=not show, position=1)
        for n, batch in bar:
            with accelerator.autocast():
                loss, metrics = step_fn(model, batch)
            accelerator.backward(loss)
            _step_with_warmup(optimizer, global_step, config.warmup_steps)
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            train_totals.add(loss, n, metrics)
            value = float(loss.detach().float().item())
            if accelerator.scaler is None:  # (fp16's loss scaling skips an overflowing step by design)
                check_finite_loss(value, f"epoch {epoch} step {global_step}")
            running += value * n
            running_n += n
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if global_step % config.log_every == 0:
                logger.info("epoch %d step %d: train loss %.4f", epoch, global_step, running / running_n)
                running, running_n = 0.0, 0
            epoch_batches += 1
            if config.max_steps is not None and global_step >= config.max_steps:
                hit_max_steps = True
                break
        bar.close()
        # Stopped inside the epoch: what follows must leave the state exactly
        # as it is now, for resume to continue the epoch.
        partial = hit_max_steps and epoch_batches < len(train_loader)
        if partial:
            train_seconds = time.perf_counter() - started
            after_step_rng = rng_state()  # validation draws from it (the loader's seed)

        model.eval()
        val_totals = _Totals()
        eval_model = accelerator.unwrap_model(model)  # no DDP collectives with uneven shards
        with torch.no_grad():
            for n, batch in progress_bar(val_loader, desc=f"validate {epoch}", leave=False, disable=not show,
                                         position=1):
                batch = send_to_device(batch, accelerator.device)
                with accelerator.autocast():
                    loss, metrics = step_fn(eval_model, batch)
                val_totals.add(loss, n, metrics)
        if partial:
            set_rng_state(after_step_rng)
        else:
            scheduler.step()

        train_keys = _metric_keys(accelerator, train_totals.metrics)
        val_keys = _metric_keys(accelerator, val_totals.metrics)
        train_sums = train_totals.reduce(accelerator, train_keys)
        record: dict[str, Any] = {"epoch": epoch, "step": global_step}
        record.update(_summarise("train", *train_sums))
        record.update(_summarise("val", *val_totals.reduce(accelerator, val_keys)))
        record["lr"] = lr
        record["seconds"] = round(time.perf_counter() - started, 3)
        if partial:
            record["partial"] = True
        # A partial record of this epoch (from before a resume) is replaced.
        replaces = bool(history) and history[-1].get("partial", False) and history[-1]["epoch"] == epoch
        if replaces:
            history[-1] = record
        else:
            history.append(record)

        improved = False
        if not partial:
            epoch_done = epoch
            value = sign * float(record.get(monitor, math.nan))
            improved = value < best_val  # False for NaN
            if improved:
                best_val, best_loss, best_epoch, bad_epochs = value, record["val_loss"], epoch, 0
            else:
                bad_epochs += 1
                stopped_early = bad_epochs >= config.patience and epoch < config.epochs

        if main:
            if replaces:
                write_history(history_path, history)
            else:
                with open(history_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
                    f.flush()
            if improved:
                save_best(save_fn, accelerator.unwrap_model(model), output_dir)
        save_checkpoint(
            accelerator,
            output_dir,
            {
                "epoch": epoch_done,
                "global_step": global_step,
                "best_val_loss": best_loss if math.isfinite(best_loss) else None,
                "best_metric": sign * best_val if math.isfinite(best_val) else None,
                "best_epoch": best_epoch,
                "bad_epochs": bad_epochs,
                "scheduler": scheduler.state_dict(),
                "stopped_early": stopped_early,
                "history": history,
                "config": config.to_dict(),
                "partial_epoch": (
                    {
                        "batches": epoch_batches,
                        "seconds": train_seconds,
                        "train": {"loss": train_sums[0], "n": train_sums[1], "metrics": train_sums[2]},
                    }
                    if partial
                    else None
                ),
            },
        )

        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in record.items() if k != "epoch"}
        if partial:
            logger.info(
                "max_steps reached after %d of %d batches of epoch %d: %s (resume continues the epoch)",
                epoch_batches,
                len(train_loader),
                epoch,
                shown,
            )
            break
        logger.info("epoch %d: %s%s", epoch, shown, " (best)" if improved else "")
        epoch_bar.set_postfix({k: shown[k] for k in shown if k.startswith(("train_", "val_"))})
        epoch_bar.update(1)
        if stopped_early:
            logger.info("early stopping: no %s improvement for %d epochs (best epoch %d)", monitor, bad_epochs, best_epoch)
    epoch_bar.close()
    accelerator.wait_for_everyone()
    return FitResult(
        best_epoch=best_epoch,
        best_val_loss=best_loss if best_epoch else math.inf,
        epochs_run=epoch_done,
        stopped_early=stopped_early,
        history=history,
        monitor=monitor,
        best_metric=sign * best_val if math.isfinite(best_val) else math.nan,
        output_dir=config.output_dir,
    )


def _step_with_warmup(optimizer, step: int, warmup_steps: int) -> None:
    """One optimizer step, its learning rate scaled by (step + 1) / warmup_steps
    during the warm-up: on top of the per-epoch schedule, which keeps the
    unscaled rate (so resume needs no extra state)."""
    if step >= warmup_steps:
        optimizer.step()
        return
    scale = (step + 1) / warmup_steps
    scheduled = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] *= scale
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, scheduled):
        group["lr"] = lr
