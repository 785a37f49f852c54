"""Training the RoViST-VG model (Wang et al., 2022; RoViST §3.1 and App. B,
GROOViST App. C, Algorithm 1) on region/noun pairs.

Data: a CSV with columns ``image,bbox,phrase``: an image path (relative to
``image_root`` or absolute), a box ``"[x1, y1, x2, y2]"`` in pixels (empty =
the whole image) and the noun/entity mention of that region, e.g. converted
from Flickr30K Entities. The paper removes stopwords from the mentions
(566K pairs); do that when converting. A phrase's vector is the mean GloVe
vector of its lower-cased words; rows whose phrase has no vector are skipped
and counted (logged).

Loss (Algorithm 1)::

    I_e = tanh(W_i ViT(I_n) + b_i);  T_e = tanh(W_t T_n + b_t)
    logits = T_e I_eᵀ;  labels = (I_e I_eᵀ + T_e T_eᵀ) / 2
    L = (CE(logitsᵀ, labelsᵀ) + CE(logits, labels)) / 2

Algorithm 1 passes ``labels`` to a cross entropy as they are, but a
similarity matrix is not a distribution (rows do not sum to 1, entries may be
negative). As the CLIP-style soft-target implementations this algorithm
follows do, storyrl turns the label rows into distributions with a softmax,
``targets = softmax(labels, dim=-1)``, and uses ``targetsᵀ`` for the image
direction; the cross entropy is ``mean_rows(−Σ targets · log_softmax(logits))``.
Like those implementations, gradients flow through the targets too (no
detach), and embeddings are not normalised (the paper found no benefit).

Optimisation follows RoViST App. B: Adam, weight decay 1e-5, lr 5e-5 decayed
by 5% per epoch, batch size 64, early stopping after 3 epochs without
validation improvement, 85%/15% train/validation split of the pairs.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storyrl.config import option
from storyrl.training import Trainer
from storyrl.training.config import TrainConfig
from storyrl.training.runs import guarded

if TYPE_CHECKING:  # torch: imported where used, so `storyrl train rovist_vg --help` stays fast
    import torch

    from storyrl.models.rovist_vg import RovistVGModel

__all__ = [
    "PAIR_COLUMNS",
    "RegionPhrase",
    "RegionPhraseDataset",
    "RovistVGTrainConfig",
    "read_pairs",
    "rovist_vg_loss",
    "rovist_vg_step",
    "train_rovist_vg",
]

log = logging.getLogger(__name__)

PAIR_COLUMNS = ("image", "bbox", "phrase")
#: storyrl.models.rovist_vg.DEFAULT_VIT, spelt out: that module imports torch
#: (tests/test_train_cli_startup.py checks that the two agree).
DEFAULT_VIT = "vit_base_patch16_224"


# -- loss -------------------------------------------------------------------------


def rovist_vg_loss(image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's symmetric loss for ``m`` matching (region, noun) pairs,
    embeddings ``[m, d]`` (see the module docstring for the soft targets)."""
    import torch.nn.functional as F

    image_emb, text_emb = image_emb.float(), text_emb.float()  # stable under autocast
    logits = text_emb @ image_emb.T
    labels = (image_emb @ image_emb.T + text_emb @ text_emb.T) / 2
    targets = labels.softmax(dim=-1)
    loss_image = F.cross_entropy(logits.T, targets.T)
    loss_text = F.cross_entropy(logits, targets)
    return (loss_image + loss_text) / 2


def rovist_vg_step(model, batch) -> tuple[torch.Tensor, dict[str, Any]]:
    """``fit``'s step: the loss plus in-batch text→region retrieval hits
    (``correct``/``n`` → ``train_acc``/``val_acc`` in the history)."""
    import torch

    pixels, vectors = batch
    image_emb, text_emb = model(pixels, vectors)  # through forward, so DDP hooks run
    loss = rovist_vg_loss(image_emb, text_emb)
    with torch.no_grad():
        hits = (text_emb.float() @ image_emb.float().T).argmax(dim=1) == torch.arange(
            len(text_emb), device=text_emb.device
        )
    return loss, {"correct": hits.sum(), "n": len(hits)}


# -- data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RegionPhrase:
    """One pair: a region (``box`` of ``image``, None = whole image) and its phrase."""

    image: str
    box: tuple[float, float, float, float] | None
    phrase: str
    line: int


def _parse_box(text: str) -> tuple[float, float, float, float] | None:
    body = text.strip()
    if body[:1] in "[(" and body[-1:] in "])":
        body = body[1:-1]
    parts = body.replace(",", " ").split()
    if len(parts) != 4:
        raise ValueError("needs 4 numbers")
    values = tuple(float(p) for p in parts)
    if not all(math.isfinite(v) for v in values):
        raise ValueError("non-finite coordinate")
    if values[2] <= values[0] or values[3] <= values[1]:
        raise ValueError("x2 must exceed x1 and y2 exceed y1")
    return values  # type: ignore[return-value]


def read_pairs(
    path: str | os.PathLike, image_root: str | os.PathLike | None = None, check_images: bool = True
) -> list[RegionPhrase]:
    """The pairs of a CSV (``image,bbox,phrase``; other columns ignored).
    Image paths are resolved against ``image_root``; with ``check_images``
    each image file must exist. Errors (ValueError) name the file, line and
    problem."""
    path = str(path)
    root = Path(image_root) if image_root is not None else None
    pairs: list[RegionPhrase] = []
    checked: dict[str, bool] = {}
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            columns = [c.strip() for c in reader.fieldnames or []]
            missing = [c for c in PAIR_COLUMNS if c not in columns]
            if missing:
                raise ValueError(
                    f"{path}, line 1: missing column(s) {', '.join(missing)}; header: {', '.join(columns)}"
                )
            reader.fieldnames = columns
            for row in reader:
                line = reader.line_num
                image = (row.get("image") or "").strip()
                phrase = " ".join((row.get("phrase") or "").split())
                bbox = (row.get("bbox") or "").strip()
                if not image:
                    raise ValueError(f"{path}, line {line}: empty image")
                if not phrase:
                    raise ValueError(f"{path}, line {line}: empty phrase")
                try:
                    box = _parse_box(bbox) if bbox else None
                except ValueError as exc:
                    raise ValueError(
                        f"{path}, line {line}: bad bbox {bbox!r} ({exc}); expected '[x1, y1, x2, y2]'"
                    ) from None
                file = Path(image)
                if root is not None and not file.is_absolute():
                    file = root / file
                name = str(file)
                if check_images:
                    if name not in checked:
                        checked[name] = file.is_file()
                    if not checked[name]:
                        raise ValueError(f"{path}, line {line}: image file not found: {name}")
                pairs.append(RegionPhrase(name, box, phrase, line))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read pairs: {exc.strerror or exc}") from exc
    except (csv.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: malformed CSV: {exc}") from exc
    return pairs


def pair_vocabulary(pairs: list[RegionPhrase]) -> set[str]:
    """The lower-cased words of the pairs' phrases (the GloVe words needed)."""
    return {w for p in pairs for w in p.phrase.lower().split()}


def __getattr__(name: str):
    # RegionPhraseDataset subclasses torch's Dataset: loaded on first use
    if name == "RegionPhraseDataset":
        from storyrl.training.judges.rovist_vg_data import RegionPhraseDataset

        return RegionPhraseDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- configuration and entry point -------------------------------------------------------


@dataclass(kw_only=True)
class RovistVGTrainConfig(TrainConfig):
    """:class:`TrainConfig` plus the data and model; optimiser defaults are
    the paper's (RoViST App. B)."""

    pairs: str = option(help="CSV of image,bbox,phrase training pairs.", path="file")
    glove: str = option(help="GloVe word vectors, text format (300-d for the paper's model).", path="file")
    image_root: str | None = option(None, "Directory that the pairs' image paths are resolved against.", path="dir")
    vit: str = option(DEFAULT_VIT, "timm image backbone.")
    pretrained_vit: bool = option(True, "Start from the backbone's pretrained weights.")
    embed_dim: int = option(1024, "Joint embedding width.", min=1)
    timm_kwargs: dict[str, Any] = option(factory=dict, help="Extra timm.create_model options.", cli=False)
    check_images: bool = option(True, "Check that every image file exists before training.")
    # The paper's settings where they differ from TrainConfig's (weight decay
    # 1e-5, lr decay 0.95 and the 15% validation split are the same).
    batch_size: int = option(64, "Examples per optimizer step.", min=1)
    lr: float = option(5e-5, "AdamW learning rate.")
    patience: int = option(3, "Early stopping: epochs without validation-loss improvement.", min=1)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded random (train, validation) split of ``range(n)``; both non-empty."""
    if n < 2:
        raise ValueError(f"need at least 2 usable pairs to split into training and validation, got {n}")
    import torch

    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


@guarded
def train_rovist_vg(
    config: RovistVGTrainConfig, resume: bool = False, progress: bool = True, model: RovistVGModel | None = None
):
    """Train RoViST-VG; the best model (lowest validation loss) is saved to
    ``output_dir/best`` in the reward's format. ``model`` replaces the one the
    config describes (e.g. a tiny one in tests). Returns the ``FitResult``."""
    from torch.utils.data import Subset

    from storyrl.models.glove import load_glove
    from storyrl.models.hub import require_hub_model, timm_hub_id
    from storyrl.models.rovist_vg import RovistVGModel
    from storyrl.training.loop import fit
    from storyrl.training.judges.rovist_vg_data import RegionPhraseDataset

    hub_id = (timm_hub_id(config.vit, (config.timm_kwargs or {}).get("pretrained_cfg_overlay"))
              if model is None and config.pretrained_vit else None)
    if hub_id:  # before the pairs and GloVe load
        require_hub_model(hub_id, what=f"timm model {config.vit!r} (weights)",
                          hint="train from random weights (--no-pretrained-vit) or give local weights as "
                               "timm_kwargs: {pretrained_cfg_overlay: {file: PATH}} in the YAML")
    pairs = read_pairs(config.pairs, config.image_root, check_images=config.check_images)
    if not pairs:
        raise ValueError(f"{config.pairs}: no pairs")
    glove = load_glove(config.glove, vocabulary=pair_vocabulary(pairs))
    log.info("%d pairs; %d of their words have GloVe vectors", len(pairs), len(glove))
    if model is None:
        model = RovistVGModel.from_config(
            config.vit, config.pretrained_vit, config.embed_dim, glove.dim, timm_kwargs=config.timm_kwargs
        )
    if model.word_dim != glove.dim:
        raise ValueError(f"{config.glove}: {glove.dim}-d vectors but the model's text encoder takes {model.word_dim}")
    dataset = RegionPhraseDataset(pairs, glove, model.image_transform())
    train_idx, val_idx = split_indices(len(dataset), config.val_fraction, config.seed)
    output = Path(config.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    config.to_yaml(output / "train_config.yaml")  # which pairs/GloVe the model was trained with
    return fit(
        model,
        Subset(dataset, train_idx),
        Subset(dataset, val_idx),
        config,
        rovist_vg_step,
        save_fn=RovistVGModel.save_pretrained,
        resume=resume,
        progress=progress,
    )


TRAINER = Trainer(RovistVGTrainConfig, train_rovist_vg)
