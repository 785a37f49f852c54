"""Training the RoViST-C coherence model (sentence-order prediction).

RoViST (Wang et al., 2022, §3.2 and App. B) fine-tunes ALBERT (albert-large-v1)
on sentence pairs from VIST and ROCStories: a positive is two segments in story
order, its negative the same two swapped. Adam (lr 1e-5, weight decay 1e-5),
lr x0.95 per epoch, batch 32, 85/15 train/validation split, early stopping
after 5 epochs without validation-loss improvement. ``mode="prefix"`` (the
d_HM scorer's variant, default) pairs each sentence with all earlier
sentences; ``mode="adjacent"`` with the previous one only (the original).

The result (``output_dir/best``) is a storyrl coherence directory:
``create_reward("coherence", model="<output_dir>/best")``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storyrl.config import option
from storyrl.rewards.coherence import MODES
from storyrl.training import Trainer
from storyrl.training.config import TrainConfig
from storyrl.training.runs import guarded, process_state

if TYPE_CHECKING:  # torch: imported where used, so `storyrl train coherence --help` stays fast
    import torch

    from storyrl.training.loop import FitResult

__all__ = [
    "CoherenceTrainConfig",
    "SOPExample",
    "build_sop_examples",
    "load_story_texts",
    "sop_step",
    "split_examples",
    "train_coherence",
]

logger = logging.getLogger(__name__)


class SOPExample(tuple):
    """``(first, second, label)``, a plain tuple to everyone else, carrying
    the index of its story (``.story``) so splits can keep stories whole."""

    story: int | None

    def __new__(cls, first: str, second: str, label: int, story: int | None = None):
        self = super().__new__(cls, (first, second, label))
        self.story = story
        return self

    def __getnewargs__(self):  # pickling (DataLoader workers) keeps .story
        return (*self, self.story)


def build_sop_examples(stories: Iterable[str], mode: str = "prefix", seed: int = 0) -> list[tuple[str, str, int]]:
    """Sentence-order-prediction examples, in story order.

    For each story with >= 2 sentences (``storyrl.text.split_sentences``) and
    each pair ``(first, sentence_i)`` from
    :func:`storyrl.rewards.coherence.sentence_pairs`: the positive
    ``(first, sentence_i, 1)`` then the negative ``(sentence_i, first, 0)``.
    Pairs whose first segment equals the sentence are skipped (the scorer gives
    them 0 without the model). The construction is deterministic; ``seed`` is
    accepted for API stability and unused (shuffling is the data loader's).
    """
    from storyrl.rewards.coherence import MODES, sentence_pairs
    from storyrl.text import split_sentences

    del seed
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    examples: list[tuple[str, str, int]] = []
    for index, story in enumerate(stories):
        sentences = split_sentences(story)
        if len(sentences) < 2:
            continue
        for first, sentence in sentence_pairs(sentences, mode):
            if first.strip() == sentence.strip():
                continue
            examples.append(SOPExample(first, sentence, 1, story=index))
            examples.append(SOPExample(sentence, first, 0, story=index))
    return examples


def _story_key(example: Sequence) -> Any:
    story = getattr(example, "story", None)
    if story is not None:
        return ("story", story)
    # Plain tuples: at least keep a pair and its swapped negative together.
    return ("pair", frozenset((example[0], example[1])))


def split_examples(
    examples: Sequence[tuple[str, str, int]], val_fraction: float = 0.15, seed: int = 0
) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    """(train, val) split BY STORY (a story's pairs all land on one side), with
    ``round(val_fraction * stories)`` validation stories (at least one, and at
    least one left for training when there are two or more). Examples keep
    their order within each side."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    keys = list(dict.fromkeys(_story_key(e) for e in examples))
    if not keys:
        return [], []
    n_val = round(val_fraction * len(keys))
    n_val = min(max(n_val, 1), max(len(keys) - 1, 1))
    shuffled = keys[:]
    random.Random(seed).shuffle(shuffled)
    val_keys = set(shuffled[:n_val])
    train = [e for e in examples if _story_key(e) not in val_keys]
    val = [e for e in examples if _story_key(e) in val_keys]
    return train, val


@dataclass(kw_only=True)
class CoherenceTrainConfig(TrainConfig):
    """:class:`TrainConfig` (paper defaults) plus the RoViST-C data and model."""

    stories: list[str] = option(help="Story files: JSON {id: story} or JSONL records.", path="file")
    base_model: str = option("albert-large-v1", "ALBERT to start from (hub name or local directory).")
    tokenizer: str | None = option(None, "Tokenizer (default: base_model).")
    mode: str = option("prefix", "Sentence pairs: prefix (d_HM) or adjacent (original RoViST).", choices=MODES)
    dropout: float = option(0.4, "Dropout before the classifier, in [0, 1).")
    max_length: int = option(512, "Token limit of a pair.", min=8)
    init_from: str | None = option(None, "A storyrl coherence directory to continue from.", path="dir")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if not self.stories:
            problems.append("stories: give at least one story file")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        return problems


class _SOPCollate:
    """encode_pairs + labels; a class so DataLoader workers can pickle it."""

    def __init__(self, tokenizer, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, items: list[tuple[str, str, int]]) -> dict[str, torch.Tensor]:
        import torch

        from storyrl.models.coherence import encode_pairs

        batch = encode_pairs(self.tokenizer, [(a, b) for a, b, _ in items], self.max_length)
        batch["labels"] = torch.tensor([label for _, _, label in items], dtype=torch.long)
        return batch


def sop_step(model, batch: dict[str, torch.Tensor]):
    """Cross-entropy over the two classes, plus the correct count."""
    import torch

    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
    )
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.float(), labels)
    return loss, {"correct": int((logits.argmax(-1) == labels).sum()), "n": int(labels.numel())}


class _SaveCoherence:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, model, directory: Path) -> None:
        model.save_pretrained(directory, self.tokenizer)


def load_story_texts(paths: Sequence[str]) -> list[str]:
    """Stories of every file, in file order (``storyrl.data.load_stories``)."""
    from storyrl.data import load_stories

    texts: list[str] = []
    for path in paths:
        texts.extend(record.story for record in load_stories(path))
    return texts


def _build_model(config: CoherenceTrainConfig, model, tokenizer):
    from storyrl.models.coherence import CoherenceModel
    from storyrl.models.hub import local_copy_hint, require_hub_model

    if model is None:
        if config.init_from:
            model, saved_tokenizer = CoherenceModel.from_pretrained(config.init_from)
            model.dropout.p = config.dropout  # the config decides the training dropout
            tokenizer = tokenizer or saved_tokenizer
        else:
            require_hub_model(config.base_model, what="base model", hint=local_copy_hint("base_model", "--base-model"))
            model = CoherenceModel.from_base(config.base_model, dropout=config.dropout)
    if tokenizer is None:
        from transformers import AutoTokenizer

        key = "tokenizer" if config.tokenizer else "base_model"
        require_hub_model(config.tokenizer or config.base_model, what="tokenizer",
                          hint=local_copy_hint(key, f"--{key.replace('_', '-')}"))
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.base_model)
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError("the coherence tokenizer needs [CLS] and [SEP] tokens (an ALBERT/BERT-style tokenizer)")
    return model, tokenizer


@guarded
def train_coherence(
    config: CoherenceTrainConfig,
    resume: bool = False,
    progress: bool = True,
    model=None,
    tokenizer=None,
) -> FitResult:
    """Train (or continue training) a RoViST-C model; the best epoch's model is
    saved to ``config.output_dir/best`` as a storyrl coherence directory.

    ``model``/``tokenizer`` replace the ones the config names (tests inject
    tiny ones); otherwise the model comes from ``init_from`` or
    ``CoherenceModel.from_base(base_model)`` and the tokenizer from
    ``init_from``'s directory or ``AutoTokenizer(tokenizer or base_model)``.
    """
    from accelerate.utils import set_seed

    from storyrl.training.loop import fit

    texts = load_story_texts(config.stories)
    examples = build_sop_examples(texts, mode=config.mode, seed=config.seed)
    if len({e.story for e in examples}) < 2:
        raise ValueError(
            f"{', '.join(config.stories)}: need at least 2 stories with 2+ sentences for a train/validation split, "
            f"found {len({e.story for e in examples})} among {len(texts)} stories"
        )
    train, val = split_examples(examples, config.val_fraction, config.seed)
    logger.info(
        "RoViST-C data: %d stories -> %d examples (%d train, %d validation; mode=%s)",
        len(texts),
        len(examples),
        len(train),
        len(val),
        config.mode,
    )

    set_seed(config.seed)  # the new head's initialisation
    model, tokenizer = _build_model(config, model, tokenizer)

    if process_state().is_main_process:
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        config.to_yaml(output_dir / "config.yaml")

    return fit(
        model,
        train,
        val,
        config,
        sop_step,
        collate_fn=_SOPCollate(tokenizer, config.max_length),
        save_fn=_SaveCoherence(tokenizer),
        resume=resume,
        progress=progress,
    )


TRAINER = Trainer(CoherenceTrainConfig, train_coherence)
