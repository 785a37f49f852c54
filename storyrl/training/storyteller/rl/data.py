"""The prompt dataset of an RL run: one row per image sequence, the same for
PPO, GRPO and RLOO.

Columns (``datasets.Dataset``):

* ``prompt``: the generators' visual prompt template (``prompt`` in
  ``prompts_file``, default the d_HM P1-P3) rendered with the number of
  images; a plain string for a text policy whose tokenizer has no chat
  template (and for TAPM, which reads no prompt), else a conversation
  ``[{"role": "user", "content": ...}]``. For a VLM the content is one
  ``{"type": "image"}`` entry per image in ``images`` and the text, for the
  processor's chat template (TRL fills the entries with the images).
* ``images`` (VLM policies only): PIL images -- the sequence as one image,
  built as the generators build it for their ``visual`` setting (or the
  authors' ready PNG from ``sequence_image_dir``), or each image
  (``setting: separate``). Made when a row is read, not kept in memory.
* ``story_images``: the sequence's image paths, one per position (the
  rewards' ``images`` context); absent when no record's images can be
  found and the policy needs none (e.g. TAPM with features only).
* ``reference``: the human story (a record's ``reference``, else its
  ``story``); ``story_id``; ``image_ids`` (TAPM features).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from storyrl.data import StoryRecord

__all__ = ["build_dataset", "load_data", "prompt_rows"]

logger = logging.getLogger(__name__)


def load_data(config) -> list[StoryRecord]:
    """The records of ``config.data`` (first ``limit``)."""
    from storyrl.datasets import load_some_records

    return load_some_records(config.data, config.data_format, config.limit)


class _Prompter:
    """Prompt text and images of a sequence, from the generators' pieces
    (template lookup and sequence images of the prompting generator)."""

    def __init__(self, config, kind: str, processing_class: Any) -> None:
        from storyrl.generators.prompting import PromptingGenerator

        self.generator = PromptingGenerator(config.prompting_config())
        self.setting = config.resolved_setting(kind)
        self.kind = kind
        self.image_root = config.image_root
        if kind == "vlm":
            if not _has_chat_template(processing_class):
                raise ValueError(f"model {config.model}: its processor has no chat template; a VLM policy's prompts "
                                 "are conversations (set one on the processor)")
            self.chat = True
        else:
            self.chat = kind == "causal_lm" and _has_chat_template(processing_class)

    def prompt(self, n_images: int) -> str | list[dict]:
        text = self.generator.prompt_text(n_images)
        if self.kind == "vlm":
            entries = 1 if self.setting == "visual" else n_images
            return [{"role": "user", "content": [*({"type": "image"} for _ in range(entries)),
                                                 {"type": "text", "text": text}]}]
        return [{"role": "user", "content": text}] if self.chat else text

    def images(self, story_id: str, paths: Sequence[Any]) -> list:
        from storyrl.images import Region, load_region

        if self.setting == "visual":
            record = StoryRecord(story_id, "", images=list(paths))
            return [self.generator._sequence_image(record, list(paths))]
        return [load_region(Region(p)) for p in paths]


def _has_chat_template(processing_class: Any) -> bool:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return bool(getattr(processing_class, "chat_template", None) or getattr(tokenizer, "chat_template", None))


def _sequence(record: StoryRecord, image_root: str | None) -> list[str] | None:
    from storyrl.images import resolve_images

    if not record.images and not record.image_ids:
        return None
    return resolve_images(record.images, record.image_ids, image_root)


def _base_rows(config, records: Sequence[StoryRecord], prompter: _Prompter) -> list[dict]:
    """Rows without the policy's images; ``story_images`` per the module docs."""
    sequences, failures = [], []
    for record in records:
        try:
            sequences.append(_sequence(record, config.image_root))
        except ValueError as exc:  # ImageError names the file
            sequences.append(None)
            failures.append((record.story_id, exc))
    found = [s for s in sequences if s is not None]
    if prompter.kind == "vlm" or (found and failures):
        if failures:
            story_id, exc = failures[0]
            raise ValueError(f"{config.data}: story {story_id!r}: {exc}"
                             + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    rows = []
    for record, sequence in zip(records, sequences):
        n = len(sequence) if sequence is not None else len(record.images or record.image_ids or [])
        if n == 0:
            raise ValueError(f"{config.data}: story {record.story_id!r} has no images or image ids")
        row = {"prompt": prompter.prompt(n),
               "reference": record.reference if record.reference is not None else (record.story or None),
               "story_id": str(record.story_id),
               "image_ids": list(record.image_ids) if record.image_ids else None}
        if found:
            row["story_images"] = [str(p) for p in sequence]
        rows.append(row)
    if not found and prompter.kind != "vlm":
        logger.info("%s: no images found for the stories; rewards get no images context", config.data)
    return rows


def prompt_rows(config, records: Sequence[StoryRecord], kind: str, processing_class: Any) -> list[dict]:
    """The dataset rows of ``records`` as dicts, images (VLM) loaded."""
    prompter = _Prompter(config, kind, processing_class)
    rows = _base_rows(config, records, prompter)
    if kind == "vlm":
        for row in rows:
            row["images"] = prompter.images(row["story_id"], row["story_images"])
    return rows


class _AddImages:
    """Dataset transform: a VLM row's images, made when the row is read (a
    VIST training set's sequence images would not fit in memory). The last
    ``cache_size`` sequences are kept: GRPO/RLOO read each prompt once per
    generation of its group."""

    def __init__(self, prompter: _Prompter, cache_size: int = 64) -> None:
        self.prompter, self.cache_size = prompter, cache_size
        self.cache: OrderedDict[tuple, list] = OrderedDict()

    def images(self, story_id: str, paths: Sequence[str]) -> list:
        key = (story_id, tuple(paths))
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        images = self.cache[key] = self.prompter.images(story_id, paths)
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return images

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        batch = dict(batch)
        batch["images"] = [self.images(sid, paths) for sid, paths in zip(batch["story_id"], batch["story_images"])]
        return batch


def build_dataset(config, kind: str, processing_class: Any, records: Sequence[StoryRecord] | None = None):
    """The prompt dataset (module docs) of ``records`` (default: the
    config's data)."""
    from datasets import Dataset

    records = load_data(config) if records is None else list(records)
    prompter = _Prompter(config, kind, processing_class)
    rows = _base_rows(config, records, prompter)
    dataset = Dataset.from_list(rows)
    if kind == "vlm":
        dataset = dataset.with_transform(_AddImages(prompter))
    return dataset
