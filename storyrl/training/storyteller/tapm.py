"""Training a TAPM-style storyteller in two stages (Yu et al. 2021; d_HM §5).

1. **Adaptation** (``adaptation_epochs``, default 3): the decoder is frozen
   and only the visual encoder learns, from TAPM's ranking loss between the
   decoder's state at each sentence's start token and the image's visual
   encoding (:func:`storyrl.generators.tapm.losses.adaptation_loss`).
2. **Downstream** (``epochs``): cross-entropy of each sentence after its
   image's visual prefix; the encoder and the decoder train (only the LoRA
   adapters of a LoRA decoder).

Both stages run :func:`storyrl.training.loop.fit` (accelerate, checkpoints,
``--resume``, progress bars, early stopping): the adaptation stage in
``output_dir/adaptation/`` (its best model starts stage 2), the downstream
stage in ``output_dir`` itself, so ``output_dir/best`` is the trained TAPM
directory (``TapmModel.from_pretrained``, ``storyrl generate --model``).
Visual features come from a ``storyrl features`` directory.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storyrl.config import option
from storyrl.training import Trainer
from storyrl.training.config import TrainConfig
from storyrl.training.runs import guarded, process_state

if TYPE_CHECKING:  # torch: imported where used, so `storyrl train tapm --help` stays fast
    from storyrl.training.loop import FitResult

__all__ = ["TapmTrainConfig", "train_tapm"]

logger = logging.getLogger(__name__)

ADAPTATION_DONE = "done.json"


@dataclass(kw_only=True)
class TapmTrainConfig(TrainConfig):
    """:class:`TrainConfig` plus TAPM's data, model and stages. ``epochs`` are
    the downstream epochs. AdamW with 4,000 linear warm-up steps, as TAPM
    (the warm-up restarts in each stage)."""

    stories: list[str] = option(help="Story files: VIST story-in-sequence JSON or JSONL records with image ids.",
                                path="file")
    features: str = option(help="Feature directory written by `storyrl features`.", path="dir")
    decoder: str = option("gpt2", "Decoder: any causal LM by hub name or local path (gpt2, meta-llama/Llama-2-7b-hf).")
    tokenizer: str | None = option(None, "Tokenizer (default: the decoder's).")
    quantization: str | None = option(None, "Load the decoder in 4 bit (bitsandbytes, CUDA).", choices=("4bit",))
    lora: bool = option(False, "Train LoRA adapters instead of the whole decoder.")
    lora_r: int = option(8, "LoRA rank.", min=1)
    lora_alpha: int = option(8, "LoRA alpha.", min=1)
    lora_dropout: float = option(0.05, "LoRA dropout.")
    lora_targets: list[str] = option(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                     help="Modules that get adapters.", cli=False)
    encoder_dim: int | None = option(None, "Visual encoder width (default: the decoder's hidden size).", min=1)
    dropout: float = option(0.5, "Dropout on the visual prefix.")
    adaptation_epochs: int = option(3, "Epochs of the adaptation stage (decoder frozen); 0 skips it.", min=0)
    margin: float = option(1.0, "Margin of the adaptation ranking loss.")
    max_length: int = option(40, "Token limit of a sentence (EOS included).", min=2)
    init_from: str | None = option(None, "A TAPM directory to start from (skips nothing: both stages run).",
                                   path="dir")
    # TAPM's settings where they differ from TrainConfig's.
    epochs: int = option(27, "Downstream epochs (TAPM: 30 in total with 3 of adaptation).", min=1)
    batch_size: int = option(8, "Stories per optimizer step.", min=1)
    lr: float = option(5e-5, "AdamW learning rate.")
    weight_decay: float = option(0.01, "AdamW weight decay.")
    optimizer: str = option("adamw", "Optimizer (TAPM: adamw).", choices=("adam", "adamw"))
    warmup_steps: int = option(4000, "Linear warm-up steps of each stage (TAPM: 4,000).", min=0)
    lr_decay: float = option(1.0, "ExponentialLR gamma per epoch (1: constant).")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if not self.stories:
            problems.append("stories: give at least one story file")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if self.quantization and not self.lora:
            problems.append("quantization: a 4-bit decoder trains through LoRA adapters only; set lora: true")
        return problems


class _Collate:
    """Stories → padded features (B, G, L, D), the image mask (B, G) and one
    token row per real image (story-major): P prefix placeholders, the start
    token, the sentence and EOS; labels only on the sentence and EOS."""

    def __init__(self, store, tokenizer, prefix_length: int, start_id: int, eos_id: int, pad_id: int,
                 max_length: int) -> None:
        self.store, self.tokenizer = store, tokenizer
        self.P, self.start, self.eos, self.pad, self.max_length = prefix_length, start_id, eos_id, pad_id, max_length

    def __call__(self, examples) -> dict[str, Any]:
        import torch

        B, G = len(examples), max(len(e.keys) for e in examples)
        types = self.store.types
        features = {t: torch.zeros(B, G, spec["tokens"], spec["dim"]) for t, spec in types.items()}
        mask = torch.zeros(B, G, dtype=torch.bool)
        rows = []
        for b, example in enumerate(examples):
            got = self.store.get(example.keys, where=f" (story {example.story_id!r})")
            for t in types:
                features[t][b, : len(example.keys)] = got[t]
            mask[b, : len(example.keys)] = True
            for sentence in example.sentences:
                ids = self.tokenizer(" " + sentence.strip(), add_special_tokens=False)["input_ids"]
                rows.append(ids[: self.max_length - 1] + [self.eos])
        T = self.P + 1 + max(len(r) for r in rows)
        input_ids = torch.full((len(rows), T), self.pad, dtype=torch.long)
        labels = torch.full((len(rows), T), -100, dtype=torch.long)
        attention = torch.zeros((len(rows), T), dtype=torch.long)
        for n, row in enumerate(rows):
            end = self.P + 1 + len(row)
            input_ids[n, : self.P + 1] = self.start
            input_ids[n, self.P + 1 : end] = torch.tensor(row)
            labels[n, self.P + 1 : end] = torch.tensor(row)
            attention[n, :end] = 1
        return {"features": features, "image_mask": mask, "input_ids": input_ids,
                "attention_mask": attention, "labels": labels}


def _core(model):
    return getattr(model, "module", model)  # DDP wraps the TAPM model


class _Step:
    """fit's step function for one stage."""

    def __init__(self, stage: str, margin: float = 1.0) -> None:
        self.stage, self.margin = stage, margin

    def __call__(self, model, batch):
        import torch

        from storyrl.generators.tapm.losses import adaptation_loss

        tapm = _core(model)
        mask = batch["image_mask"]
        prefix, pooled, directions = tapm.encode(batch["features"], mask)
        flat = prefix[mask]
        if self.stage == "downstream":
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], visual_prefix=flat,
                        labels=batch["labels"], use_cache=False)
            return out.loss, {}
        # Adaptation: the start token's state depends on the prefix only
        # (causal attention), so the sentence is not run; the decoder is
        # frozen and its state is a fixed target (no gradient through it).
        P = flat.shape[1]
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"][:, : P + 1], attention_mask=batch["attention_mask"][:, : P + 1],
                        visual_prefix=flat, output_hidden_states=True, use_cache=False)
        h = torch.zeros_like(pooled)
        h[mask] = out.hidden_states[-1][:, P].to(h.dtype)
        return adaptation_loss(h, pooled, directions, mask, self.margin)


class _Save:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, model, directory: Path) -> None:
        model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def _split(examples: list, val_fraction: float, seed: int) -> tuple[list, list]:
    if len(examples) < 2:
        raise ValueError(f"TAPM: need at least 2 usable stories for a train/validation split, got {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = min(len(examples) - 1, max(1, round(val_fraction * len(examples))))
    val = set(order[:n_val])
    return [e for i, e in enumerate(examples) if i not in val], [e for i, e in enumerate(examples) if i in val]


def _load_weights(model, directory: Path) -> None:
    """The weights of a saved TAPM directory into ``model`` (same architecture)."""
    from safetensors.torch import load_file

    from storyrl.generators.tapm.model import WEIGHTS

    state = load_file(str(directory / WEIGHTS))
    _, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{directory}: weights do not fit the model (e.g. {unexpected[0]})")


def _build(config: TapmTrainConfig, store, model, tokenizer):
    from storyrl.generators.tapm.model import TapmModel
    from storyrl.models.hub import local_copy_hint, require_hub_model

    if tokenizer is None:
        from transformers import AutoTokenizer

        name = config.tokenizer or config.init_from or config.decoder
        key = "tokenizer" if config.tokenizer else "decoder"
        require_hub_model(name, what="tokenizer", hint=local_copy_hint(key, f"--{key}"))
        tokenizer = AutoTokenizer.from_pretrained(name)
    if model is None:
        if config.init_from:
            model = TapmModel.from_pretrained(config.init_from)
        else:
            require_hub_model(config.decoder, what="TAPM decoder", hint=local_copy_hint("decoder", "--decoder"))
            lora = ({"r": config.lora_r, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
                     "target_modules": list(config.lora_targets)} if config.lora else None)
            model = TapmModel.from_decoder(
                config.decoder, tokenizer, {t: s["dim"] for t, s in store.types.items()},
                {t: s["tokens"] for t, s in store.types.items()}, lora=lora, quantization=config.quantization,
                encoder_dim=config.encoder_dim, dropout=config.dropout, backbones=store.backbones, seed=config.seed)
    if set(model.config.feature_dims) != set(store.types) or any(
            model.config.feature_dims[t] != s["dim"] for t, s in store.types.items()):
        raise ValueError(f"{config.features}: feature types {store.types} do not match the model's "
                         f"{model.config.feature_dims}")
    return model, tokenizer


@guarded
def train_tapm(config: TapmTrainConfig, resume: bool = False, progress: bool = True, model=None,
               tokenizer=None) -> FitResult:
    """Run both stages (see the module docs); returns the downstream stage's
    :class:`FitResult`. ``model``/``tokenizer`` replace the ones the config
    names (tests inject tiny ones)."""

    from storyrl.generators.tapm.data import load_examples
    from storyrl.generators.tapm.features import FeatureStore
    from storyrl.training.checkpoints import find_checkpoint
    from storyrl.training.loop import fit

    store = FeatureStore(config.features)
    examples = load_examples(config.stories)
    for example in examples:  # fail before any training, naming the story
        missing = [k for k in example.keys if k not in store]
        if missing:
            raise ValueError(f"{config.features}: no features for image {missing[0]!r} of story "
                             f"{example.story_id!r} (run `storyrl features` on {', '.join(config.stories)})")
    train, val = _split(examples, config.val_fraction, config.seed)
    logger.info("TAPM data: %d stories (%d train, %d validation)", len(examples), len(train), len(val))

    model, tokenizer = _build(config, store, model, tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    cfg = model.config
    collate = _Collate(store, tokenizer, cfg.prefix_length(), cfg.start_token_id, cfg.eos_token_id,
                       cfg.pad_token_id, config.max_length)
    output_dir = Path(config.output_dir)
    adapt_dir = output_dir / "adaptation"
    if process_state().is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")

    downstream_resume = resume and find_checkpoint(output_dir) is not None
    if config.adaptation_epochs and not downstream_resume:
        if not (resume and (adapt_dir / ADAPTATION_DONE).is_file()):
            model.set_stage("adaptation")
            adapt_config = replace(config, output_dir=str(adapt_dir), epochs=config.adaptation_epochs)
            result = fit(model, train, val, adapt_config, _Step("adaptation", config.margin), collate_fn=collate,
                         save_fn=_Save(tokenizer), resume=resume and find_checkpoint(adapt_dir) is not None,
                         progress=progress)
            if config.max_steps is not None and result.epochs_run < config.adaptation_epochs:
                logger.info("max_steps reached in the adaptation stage; --resume continues it")
                return result
            if process_state().is_main_process:
                (adapt_dir / ADAPTATION_DONE).write_text(json.dumps({"best_epoch": result.best_epoch}) + "\n")
        if (adapt_dir / "best").is_dir():
            _load_weights(model, adapt_dir / "best")  # stage 2 starts from the best adapted encoder
    model.set_stage("downstream")
    return fit(model, train, val, config, _Step("downstream"), collate_fn=collate, save_fn=_Save(tokenizer),
               resume=downstream_resume, progress=progress)


TRAINER = Trainer(TapmTrainConfig, train_tapm)
