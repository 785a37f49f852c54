"""Training Vrank (Hsu et al., 2022, §4 and App.) on VHED-format CSVs:
``storyrl train vrank --config configs/training/vrank.yaml``.

As in the paper: the encoder (default the supervised SimCSE BERT) reads
``story1 [SEP] story2``, a regression head predicts the rank gap, MSE loss;
every training pair is also added in the other order with the gap negated
(the paper's "symmetric dataset"); Adam, lr 2e-5, 30 epochs, batch 32, fp16
mixed precision on GPU, seed 7777; all agreement levels are trained on;
zero-gap pairs are dropped (:func:`storyrl.judgements.vhed.load_vhed`).

Data: ``train_csv`` + ``val_csv`` (+ optional ``test_csv``), or one ``vhed``
CSV split here with ``seed``: 8:1:1 (``val_fraction``/``test_fraction``) by
IMAGE SEQUENCE, so that all pairs of one sequence land on one side (the paper
gives the ratio, not its unit; splitting by pair would put stories of one
sequence on both sides). A training pair whose other order is already in the
file is not added twice.

Target (``target``): ``label`` (default), the raw gap avg_rank(story1) −
avg_rank(story2), which the paper names as what Vrank predicts; or
``rank_norm``, VHED's normalised gap. Validation and test pairs are read in
the file's order only (one prediction per human judgement, as evaluated in
the paper).

Model selection (a storyrl choice; the paper stored checkpoints every 500
steps without saying how one was chosen): after every epoch the validation
pair accuracy (sign of the prediction vs sign of the human gap; a zero
prediction counts wrong, as a tie does in the paper's protocol) is
``val_acc``; ``best/`` is the epoch with the highest (``early_stopping:
val_acc``, default) or the lowest validation loss (``val_loss``), and
training stops after ``patience`` epochs without improvement. With a
``test_csv`` (or test split), the best model's test loss and accuracy are
written to ``output_dir/test_metrics.json``.

Deviations: ``mixed_precision`` defaults to ``auto``, the authors' fp16 on
CUDA and fp32 (``no``) on the CPU, where fp16 autocast works but is slow
(``fp16`` asks for it anywhere); the paper's MLM pre-training of SimCSE on VIST stories is not part of this
trainer (give its result as ``base_model``). The result (``output_dir/best``)
is a Vrank directory: ``create_reward("vrank", model="<output_dir>/best")``.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from storyrl.config import option
from storyrl.training import Trainer
from storyrl.training.accelerators import MIXED_PRECISIONS
from storyrl.training.config import TrainConfig
from storyrl.training.runs import guarded, process_state

if TYPE_CHECKING:  # torch: imported where used, so `storyrl train vrank --help` stays fast
    import torch

    from storyrl.training.loop import FitResult

__all__ = [
    "VrankExample",
    "VrankTrainConfig",
    "pair_examples",
    "split_by_image_sequence",
    "train_vrank",
    "vrank_step",
]

logger = logging.getLogger(__name__)

TARGETS = ("label", "rank_norm")
MONITORS = {"val_acc": True, "val_loss": False}  # name -> maximise


class VrankExample(tuple):
    """``(story1, story2, target, sign)``: ``sign`` is the sign of the human
    gap (−1: story1 better), what the accuracy is measured against."""

    def __new__(cls, story1: str, story2: str, target: float, sign: float):
        return super().__new__(cls, (story1, story2, float(target), float(sign)))


def _sign(x: float) -> float:
    return 1.0 if x > 0 else -1.0 if x < 0 else 0.0


def pair_examples(pairs: Sequence, target: str = "label", both_orders: bool = False) -> list[VrankExample]:
    """Examples from :class:`~storyrl.judgements.vhed.VHEDPair` s in file
    order; with ``both_orders`` each is followed by its swap (target and sign
    negated) unless the file already holds that order."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    present = {(p.story1, p.story2) for p in pairs}
    out = []
    for p in pairs:
        value = p.gap if target == "label" else p.rank_norm
        out.append(VrankExample(p.story1, p.story2, value, _sign(p.gap)))
        if both_orders and (p.story2, p.story1) not in present:
            out.append(VrankExample(p.story2, p.story1, -value, -_sign(p.gap)))
    return out


def split_by_image_sequence(pairs: Sequence, val_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 0):
    """(train, val, test) pairs: image sequences (``img_seq``) shuffled with
    ``seed``, ``round(fraction * sequences)`` to test and to validation (at
    least one to validation, at least one left for training); pairs keep file
    order within each side."""
    groups = list(dict.fromkeys(p.img_seq for p in pairs))
    shuffled = groups[:]
    random.Random(seed).shuffle(shuffled)
    n_test = round(test_fraction * len(groups))
    n_val = max(1, round(val_fraction * len(groups)))
    if n_test + n_val >= len(groups):
        raise ValueError(
            f"{len(groups)} image sequences are too few for a train/validation/test split "
            f"(val_fraction={val_fraction}, test_fraction={test_fraction})"
        )
    test_groups, val_groups = set(shuffled[:n_test]), set(shuffled[n_test : n_test + n_val])
    train = [p for p in pairs if p.img_seq not in test_groups | val_groups]
    val = [p for p in pairs if p.img_seq in val_groups]
    test = [p for p in pairs if p.img_seq in test_groups]
    return train, val, test


@dataclass(kw_only=True)
class VrankTrainConfig(TrainConfig):
    """:class:`TrainConfig` with the paper's settings plus the VHED data and model."""

    vhed: str | None = option(None, "One VHED-format CSV, split here by image sequence (val/test_fraction).",
                              path="file")
    train_csv: str | None = option(None, "VHED-format training CSV (instead of vhed).", path="file")
    val_csv: str | None = option(None, "VHED-format validation CSV (with train_csv).", path="file")
    test_csv: str | None = option(None, "VHED-format test CSV (optional, with train_csv).", path="file")
    test_fraction: float = option(0.1, "Fraction of the image sequences held out for testing (with vhed), in [0, 1).")
    target: str = option("label", "Regression target: label (raw rank gap, the paper) or rank_norm.",
                         choices=TARGETS)
    early_stopping: str = option("val_acc", "Epoch selection and early stopping: val_acc (highest) or val_loss "
                                 "(lowest).", choices=tuple(MONITORS))
    base_model: str = option("princeton-nlp/sup-simcse-bert-base-uncased",
                             "Encoder to start from (any transformers encoder: hub name or local directory).")
    tokenizer: str | None = option(None, "Tokenizer (default: base_model).")
    pooling: str = option("pooler", "Pair vector: pooler ([CLS] + the encoder's pooler/SimCSE MLP) or cls "
                          "(raw [CLS]).", choices=("pooler", "cls"))
    dropout: float | None = option(None, "Dropout before the head (default: the encoder's hidden_dropout_prob).")
    max_length: int = option(512, "Token limit of a story pair (longest_first truncation).", min=8)
    init_from: str | None = option(None, "A storyrl Vrank directory to continue from.", path="dir")
    # The paper's settings (App.: Adam, lr 2e-5, 30 epochs, batch 32, fp16, seed 7777; no decay).
    epochs: int = option(30, "Maximum number of epochs.", min=1)
    lr: float = option(2e-5, "Learning rate.")
    weight_decay: float = option(0.0, "Weight decay.")
    lr_decay: float = option(1.0, "ExponentialLR gamma per epoch (1: constant, the paper).")
    val_fraction: float = option(0.1, "Fraction of the image sequences held out for validation (with vhed).")
    seed: int = option(7777, "Seed of the split, the initialisation and the data order.")
    mixed_precision: str = option("auto", "Mixed precision: auto = fp16 (the paper's) on CUDA, no (fp32) on the "
                                  "CPU; no, fp16 (autocast + loss scaling) or bf16 anywhere.",
                                  choices=MIXED_PRECISIONS)

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.vhed is not None and (self.train_csv or self.val_csv or self.test_csv):
            problems.append("give either vhed (one CSV, split here) or train_csv/val_csv/test_csv, not both")
        elif self.vhed is None and not (self.train_csv and self.val_csv):
            problems.append("data: give vhed (one CSV) or both train_csv and val_csv")
        if not 0.0 <= self.test_fraction < 1.0:
            problems.append(f"test_fraction must be in [0, 1), got {self.test_fraction}")
        elif self.val_fraction + self.test_fraction >= 1.0:
            problems.append("val_fraction + test_fraction must be below 1")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        return problems


class _PairCollate:
    """Pair encoding + targets and signs; a class so DataLoader workers can pickle it."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items: list[VrankExample]) -> dict[str, torch.Tensor]:
        import torch

        from storyrl.models.vrank import encode_story_pairs

        batch = encode_story_pairs(self.tokenizer, [e[0] for e in items], [e[1] for e in items], self.max_length)
        batch["targets"] = torch.tensor([e[2] for e in items], dtype=torch.float32)
        batch["signs"] = torch.tensor([e[3] for e in items], dtype=torch.float32)
        return batch


def vrank_step(model, batch: dict[str, torch.Tensor]):
    """MSE between predicted and human gaps, plus the pairs whose predicted
    sign matches the human one (a zero prediction is wrong)."""
    import torch

    inputs = {k: v for k, v in batch.items() if k not in ("targets", "signs")}
    pred = model(**inputs).float()
    loss = torch.nn.functional.mse_loss(pred, batch["targets"])
    correct = (torch.sign(pred) * batch["signs"] > 0).sum()
    return loss, {"correct": int(correct), "n": int(pred.numel())}


class _SaveVrank:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, model, directory: Path) -> None:
        model.save_pretrained(directory, self.tokenizer)


def _load_data(config: VrankTrainConfig):
    from storyrl.judgements.vhed import load_vhed

    if config.vhed is not None:
        data = load_vhed(config.vhed)
        train, val, test = split_by_image_sequence(data.pairs, config.val_fraction, config.test_fraction, config.seed)
        counts = f"{config.vhed}: {data.rows} rows, {data.zero_gap_dropped} zero-gap dropped"
    else:
        parts = [load_vhed(p) for p in (config.train_csv, config.val_csv, config.test_csv) if p]
        train, val = parts[0].pairs, parts[1].pairs
        test = parts[2].pairs if len(parts) > 2 else []
        counts = ", ".join(f"{d.path}: {d.rows} rows, {d.zero_gap_dropped} zero-gap dropped" for d in parts)
    for name, part in (("training", train), ("validation", val)):
        if not part:
            raise ValueError(f"Vrank: the {name} set is empty ({counts})")
    logger.info("Vrank data: %s -> %d train, %d validation, %d test pairs", counts, len(train), len(val), len(test))
    return train, val, test


def _build_model(config: VrankTrainConfig, model, tokenizer):
    from storyrl.models.hub import local_copy_hint, require_hub_model
    from storyrl.models.vrank import VrankModel

    if model is None:
        if config.init_from:
            model, saved_tokenizer = VrankModel.from_pretrained(config.init_from)
            model.max_length = config.max_length
            if config.dropout is not None:
                model.dropout.p = config.dropout
            tokenizer = tokenizer or saved_tokenizer
        else:
            require_hub_model(config.base_model, what="base model", hint=local_copy_hint("base_model", "--base-model"))
            model = VrankModel.from_base(config.base_model, config.pooling, config.dropout, config.max_length)
    if tokenizer is None:
        from transformers import AutoTokenizer

        key = "tokenizer" if config.tokenizer else "base_model"
        require_hub_model(config.tokenizer or config.base_model, what="tokenizer",
                          hint=local_copy_hint(key, f"--{key.replace('_', '-')}"))
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base_model)
    return model, tokenizer


def _evaluate(model, examples: list[VrankExample], tokenizer, config: VrankTrainConfig) -> dict[str, float]:
    """Loss and pair accuracy of ``model`` on ``examples`` (eval mode, fp32)."""
    import torch

    collate = _PairCollate(tokenizer, config.max_length)
    device = next(model.parameters()).device
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(examples), config.batch_size):
            chunk = examples[start : start + config.batch_size]
            batch = {k: v.to(device) for k, v in collate(chunk).items()}
            loss, metrics = vrank_step(model, batch)
            loss_sum += float(loss) * len(chunk)
            correct += metrics["correct"]
    return {"n": len(examples), "loss": loss_sum / len(examples), "acc": correct / len(examples)}


@guarded
def train_vrank(
    config: VrankTrainConfig,
    resume: bool = False,
    progress: bool = True,
    model=None,
    tokenizer=None,
) -> FitResult:
    """Train (or continue training) Vrank; the best epoch's model is saved to
    ``config.output_dir/best`` as a Vrank directory. ``model``/``tokenizer``
    replace the ones the config names (tests inject tiny ones)."""
    from accelerate.utils import set_seed

    from storyrl.training.loop import fit

    train_pairs, val_pairs, test_pairs = _load_data(config)
    train = pair_examples(train_pairs, config.target, both_orders=True)
    val = pair_examples(val_pairs, config.target)
    test = pair_examples(test_pairs, config.target)

    set_seed(config.seed)  # the new head's initialisation
    model, tokenizer = _build_model(config, model, tokenizer)
    if tokenizer.sep_token_id is None:
        raise ValueError("the Vrank tokenizer needs a separator token (a BERT-style pair encoding)")

    main = process_state().is_main_process
    output_dir = Path(config.output_dir)
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")  # as given (fp16 stays fp16 for a GPU rerun)

    result = fit(
        model,
        train,
        val,
        config,
        vrank_step,
        collate_fn=_PairCollate(tokenizer, config.max_length),
        save_fn=_SaveVrank(tokenizer),
        resume=resume,
        progress=progress,
        monitor=config.early_stopping,
        maximize=MONITORS[config.early_stopping],
    )
    if test and main and (output_dir / "best").is_dir():
        from storyrl.models.vrank import VrankModel

        best, _ = VrankModel.from_pretrained(output_dir / "best")
        metrics = {"best_epoch": result.best_epoch, **_evaluate(best, test, tokenizer, config)}
        (output_dir / "test_metrics.json").write_text(json.dumps(metrics, indent=1), encoding="utf-8")
        logger.info("Vrank test set (best epoch %d): %s", result.best_epoch, metrics)
    return result


TRAINER = Trainer(VrankTrainConfig, train_vrank)
