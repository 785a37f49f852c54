"""Training COSMiC Vanilla / Vanilla+ (Inan et al. 2021, §4.2, §5.1, §6) on
RaCCoon-format ratings (:mod:`storyrl.judgements.raccoon`).

Paper settings (defaults): MSE between the score and the normalised human
rating, Adam, lr 1e-3, batch 10, ~100 epochs; encoders frozen and their
features pre-computed, only the head trains (:mod:`storyrl.models.cosmic`).

Choices the paper leaves open or that differ, documented:

- Learning-rate schedule: the paper decays the lr "by a factor of 10^-2 every
  10 epochs"; storyrl's loop has a per-epoch exponential decay, so the default
  ``lr_decay`` is 0.01^(1/10) ≈ 0.631: the same ×0.01 per 10 epochs, smoothly
  instead of in steps.
- Reference caption: Eq. 1 needs a reference r for each RaCCoon candidate, and
  the paper does not say which (at test time it is COIN's human Visible
  caption). RaCCoon has no human caption, so r is another caption of the same
  image (same URL, different text): a Visible one first (as the test-time
  references are Visible), then the highest-rated, then the first in file
  order, with that caption's own class as r_c. A candidate whose image has no
  other caption is skipped (``no reference``).
- Validation: the paper reports none for Vanilla; ``val_fraction`` of the
  IMAGES (all their captions) is held out for early stopping (``patience``).
- ``+`` augmentation (``augment: k``, Vanilla+ = 1): for each TRAINING example,
  k negatives pairing its image (and reference) with a random caption of the
  same class from another image, rating 0 (§6). Validation stays real ratings.
- Records whose class is not in ``labels`` (e.g. Action with
  ``action_ratings: visible``) are skipped and counted; image files that
  cannot be decoded likewise (``unreadable image``), as are the loader's broken,
  unrated and missing-image rows (``data_summary.json`` in ``output_dir``).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from storyrl.config import option
from storyrl.models.runtime import PRECISIONS
from storyrl.training import Trainer
from storyrl.training.config import TrainConfig
from storyrl.training.runs import guarded, process_state

if TYPE_CHECKING:  # torch: imported where used, so `storyrl train cosmic --help` stays fast
    import torch

    from storyrl.training.loop import FitResult

__all__ = ["CosmicTrainConfig", "TRAINER", "build_examples", "cosmic_step", "train_cosmic"]

logger = logging.getLogger(__name__)

PAPER_LABELS = ["Meta", "Visible", "Subjective", "Story"]


@dataclass(kw_only=True)
class CosmicTrainConfig(TrainConfig):
    """:class:`TrainConfig` with the paper's Vanilla settings, plus data and encoders."""

    raccoon: str = option(help="RaCCoon-format TSV of caption ratings.", path="file")
    image_dir: str | None = option(None, "Folder of images named <sha1(url)>.<ext>.", path="dir")
    image_map: str | None = option(None, "URL → image file map: JSON {url: path} or TSV url/path.", path="file")
    action_ratings: str = option("skip", "Action rows: skip, or rate them on the Visible scale.",
                                 choices=("skip", "visible"))
    unrated: str = option("skip", "Rows without a rating in their class: skip, or rating 0.", choices=("skip", "zero"))
    labels: list[str] = option(factory=lambda: list(PAPER_LABELS), help="Coherence labels of the one-hot vectors.")
    augment: int = option(0, "Vanilla+: random same-class captions with rating 0 per training example.", min=0)
    use_image: bool = option(True, "Feed the image vector (False: the paper's 'No I' ablation).")
    use_labels: bool = option(True, "Feed the coherence labels (False: the 'No c' ablation).")
    image_library: str = option("timm", "Image tower library: timm or open_clip.", choices=("timm", "open_clip"))
    image_model: str = option("resnetv2_50.a1h_in1k", "timm or open_clip model name (paper: ResNet50V2).")
    image_pretrained: str | None = option("default", "timm: default (hub weights), a weights file or null (random); "
                                          "open_clip: a pretrained tag, file or null.")
    image_kwargs: dict[str, Any] = option(factory=dict, help="Extra timm.create_model arguments.", cli=False)
    text_model: str = option("bert-large-uncased", "transformers encoder for the [CLS] vectors (hub name or dir).")
    max_length: int = option(512, "Token limit of a caption.", min=8)
    device: str | None = option(None, "Device of the frozen encoders (default: CUDA when available).")
    precision: str = option("auto", "Encoder precision: auto (fp16 on CUDA), fp32, fp16, bf16.", choices=PRECISIONS)
    encoder_batch_size: int = option(32, "Images / texts per encoder forward pass.", min=1)
    # Paper defaults for Vanilla (TrainConfig's are RoViST's).
    epochs: int = option(100, "Maximum number of epochs (paper: converges in about 100).", min=1)
    batch_size: int = option(10, "Examples per optimizer step (paper: 10).", min=1)
    lr: float = option(1e-3, "Adam learning rate (paper: 1e-3).")
    weight_decay: float = option(0.0, "Weight decay (paper: none).")
    lr_decay: float = option(0.01 ** 0.1, "Per-epoch lr factor (0.01^(1/10): the paper's x0.01 per 10 epochs).")
    patience: int = option(10, "Early stopping: epochs without validation-loss improvement.", min=1)

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.use_image and self.image_dir is None and self.image_map is None:
            problems.append("give image_dir or image_map (or use_image: false)")
        if not self.labels or len(set(self.labels)) != len(self.labels):
            problems.append(f"labels must be distinct and non-empty, got {self.labels}")
        return problems

    def encoder_spec(self):
        from storyrl.models.cosmic import EncoderSpec

        return EncoderSpec(self.image_library, self.image_model, self.image_pretrained,
                           tuple(sorted(self.image_kwargs.items())), self.text_model, self.max_length)


def _pick_reference(record, siblings):
    others = [s for s in siblings if s.caption.strip() != record.caption.strip()]
    if not others:
        return None
    # Visible first, then highest rating, then file order.
    return min(others, key=lambda s: (s.coherence != "Visible", -s.rating, s.row))


def build_examples(records, labels, skipped: Counter) -> list[tuple]:
    """``(record, reference record)`` pairs (see the module docs); records
    without a reference or with a class outside ``labels`` are counted in
    ``skipped``."""
    by_image = defaultdict(list)
    for r in records:
        by_image[r.url].append(r)
    out = []
    for r in records:
        if r.coherence not in labels:
            skipped[f"label {r.coherence} not in labels"] += 1
            continue
        ref = _pick_reference(r, [s for s in by_image[r.url] if s.coherence in labels])
        if ref is None:
            skipped["no reference"] += 1
            continue
        out.append((r, ref))
    return out


def _split_by_image(pairs, val_fraction: float, seed: int):
    urls = list(dict.fromkeys(r.url for r, _ in pairs))
    if len(urls) < 2:
        raise ValueError(f"need captions of at least 2 images for a train/validation split, found {len(urls)}")
    n_val = min(max(round(val_fraction * len(urls)), 1), len(urls) - 1)
    shuffled = urls[:]
    random.Random(seed).shuffle(shuffled)
    val_urls = set(shuffled[:n_val])
    return [p for p in pairs if p[0].url not in val_urls], [p for p in pairs if p[0].url in val_urls]


class _Collate:
    """Index tuples → head inputs from the precomputed embeddings (a class:
    DataLoader workers pickle it)."""

    def __init__(self, image_emb: np.ndarray, text_emb: np.ndarray) -> None:
        self.image_emb, self.text_emb = image_emb, text_emb

    def __call__(self, items: list[tuple]) -> dict[str, torch.Tensor]:
        import torch

        img, cand, ref, cl, rl, y = (list(col) for col in zip(*items))
        return {
            "image": torch.from_numpy(self.image_emb[img]),
            "candidate": torch.from_numpy(self.text_emb[cand]),
            "reference": torch.from_numpy(self.text_emb[ref]),
            "candidate_label": torch.tensor(cl, dtype=torch.long),
            "reference_label": torch.tensor(rl, dtype=torch.long),
            "rating": torch.tensor(y, dtype=torch.float32),
        }


def cosmic_step(model, batch: dict[str, torch.Tensor]):
    """MSE between the predicted score and the normalised rating."""
    import torch

    inputs = {k: v for k, v in batch.items() if k != "rating"}
    pred = model(**inputs).float()
    return torch.nn.functional.mse_loss(pred, batch["rating"]), {}


def _save_head(model, directory: Path) -> None:
    model.save_pretrained(directory)


def _embed_images(encoders, paths: list[str], skipped: Counter) -> dict[str, np.ndarray]:
    """Embeddings of the readable images; unreadable ones are counted."""
    from storyrl.images import ImageError

    try:
        return dict(zip(paths, encoders.embed_images(paths)))
    except ImageError:
        out = {}
        for path in paths:
            try:
                out[path] = encoders.embed_images([path])[0]
            except ImageError as exc:
                logger.warning("COSMiC: skipping an unreadable image: %s", exc)
        return out


@guarded
def train_cosmic(config: CosmicTrainConfig, resume: bool = False, progress: bool = True) -> FitResult:
    """Train the COSMiC head; the best epoch's model lands in
    ``config.output_dir/best`` (``create_reward("cosmic", model=...)``)."""
    from accelerate.utils import set_seed

    from storyrl.judgements.raccoon import load_raccoon
    from storyrl.models.cosmic import CosmicHead, HeadConfig, cosmic_encoders, require_encoders
    from storyrl.training.loop import fit

    # before the (slow) data load: an unreachable hub fails at once
    require_encoders(config.encoder_spec(), "set image_pretrained to a local weights file (--image-pretrained FILE) "
                     "or null", "set text_model to a local copy's directory (--text-model DIR)")
    images_needed = config.use_image
    data = load_raccoon(config.raccoon, image_dir=config.image_dir if images_needed else None,
                        image_map=config.image_map if images_needed else None,
                        action_ratings=config.action_ratings, unrated=config.unrated)
    skipped = Counter(data.skipped)
    encoders = cosmic_encoders(config.encoder_spec(), config.device, config.precision, config.encoder_batch_size)
    records = data.records
    if images_needed:
        image_vecs = _embed_images(encoders, list(dict.fromkeys(r.image for r in records)), skipped)
        unreadable = [r for r in records if r.image not in image_vecs]
        skipped["unreadable image"] += len(unreadable)
        records = [r for r in records if r.image in image_vecs]
    pairs = build_examples(records, config.labels, skipped)
    train_pairs, val_pairs = _split_by_image(pairs, config.val_fraction, config.seed)

    # Embedding tables: every distinct image and text once.
    urls = list(dict.fromkeys(r.url for r, _ in pairs))
    url_row = {u: k for k, u in enumerate(urls)}
    image_of = {r.url: r.image for r, _ in pairs}
    text_list = list(dict.fromkeys(t for r, ref in pairs for t in (r.caption, ref.caption)))
    text_row = {t: k for k, t in enumerate(text_list)}
    text_emb = encoders.embed_texts(text_list).astype(np.float32)
    if images_needed:
        image_emb = np.stack([image_vecs[image_of[u]] for u in urls]).astype(np.float32)
        image_dim = image_emb.shape[1]
    else:
        image_dim = 1
        image_emb = np.zeros((len(urls), 1), np.float32)
    label_row = {label: k for k, label in enumerate(config.labels)}

    def item(r, ref, caption=None, rating=None):
        return (url_row[r.url], text_row[caption or r.caption], text_row[ref.caption], label_row[r.coherence],
                label_row[ref.coherence], r.rating if rating is None else rating)

    train = [item(r, ref) for r, ref in train_pairs]
    val = [item(r, ref) for r, ref in val_pairs]
    augmented = 0
    if config.augment:
        rng = random.Random(config.seed)
        by_class = defaultdict(list)
        for r, _ in train_pairs:
            by_class[r.coherence].append(r)
        for r, ref in train_pairs:
            pool = [s for s in by_class[r.coherence] if s.url != r.url]
            for _ in range(config.augment if pool else 0):
                train.append(item(r, ref, caption=rng.choice(pool).caption, rating=0.0))
                augmented += 1

    summary = data.summary()
    summary.update(skipped=dict(skipped), examples=len(pairs), train=len(train), val=len(val),
                   augmented=augmented, images=len(urls), texts=len(text_list))
    logger.info("COSMiC data: %s", summary)

    set_seed(config.seed)
    head = CosmicHead(HeadConfig(image_dim=image_dim, text_dim=encoders.text_dim, labels=tuple(config.labels),
                                 use_image=config.use_image, use_labels=config.use_labels,
                                 encoders=config.encoder_spec()))
    if process_state().is_main_process:
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")
        (output_dir / "data_summary.json").write_text(json.dumps(summary, indent=1))

    result = fit(head, train, val, config, cosmic_step, collate_fn=_Collate(image_emb, text_emb),
                 save_fn=_save_head, resume=resume, progress=progress)
    result.data = summary  # the counts, for callers (also in data_summary.json)
    return result


TRAINER = Trainer(CosmicTrainConfig, train_cosmic)
