"""The interface every story generator implements.

A generator turns *records with images* into *stories*:

* **In**: :class:`storyrl.data.StoryRecord` objects, as :func:`storyrl.data.load_stories`
  reads them from the JSONL files ``storyrl score`` reads (``story_id``,
  ``images`` or ``image_ids``; ``story`` holds the human story, which a
  generator may use as context, e.g. the previous sentence) or as
  :func:`storyrl.datasets.load_vist_sis` / :func:`storyrl.datasets.load_vwp` build them.
* **Out**: a :class:`Generations` -- ``stories`` ``{story_id: story}`` (write
  it with :meth:`Generations.save`: the JSON story set ``storyrl score``
  reads) and ``failures`` ``{story_id: error}``. A failed generation is
  recorded with its error, never as story text.

A generator declares its options as a :class:`GeneratorConfig` dataclass
(``config_class``) and implements :meth:`Generator._generate_batch`; the base
class batches the records, isolates a record whose generation raises, and
counts failures. Register it in :data:`storyrl.generators.GENERATORS`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from storyrl.config import Config, Configurable, option
from storyrl.data import StoryRecord

__all__ = ["Generations", "Generator", "GeneratorConfig"]

log = logging.getLogger(__name__)


@dataclass
class GeneratorConfig(Config):
    """Options every generator has."""

    batch_size: int = option(8, "Records per generation call.", min=1)

    #: options that change how fast, not what is generated: a resumed run may change them
    runtime_options: ClassVar[tuple[str, ...]] = ("batch_size",)


@dataclass
class Generations:
    """What a generation run produced: stories and failures, by story id."""

    stories: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Write the stories as a JSON ``{story_id: story}`` story set,
        atomically (an existing file only with ``overwrite``)."""
        from storyrl.output_files import replace_file

        replace_file(Path(path), json.dumps(self.stories, indent=1, ensure_ascii=False), overwrite=overwrite)


class Generator(Configurable):
    """Base class of storyrl generators (see the module docs)."""

    kind = "generator"
    config_class: ClassVar[type[GeneratorConfig]] = GeneratorConfig

    def setup(self) -> Generator:
        """Load the models now (otherwise done on first use)."""
        self._setup()
        return self

    def _setup(self) -> None:
        """Load models; errors here are the generator's, not a record's."""

    def metadata(self) -> dict[str, Any]:
        """What a story file's sidecar records about this generator: its
        name and options (subclasses add model revisions, prompt texts)."""
        return {"generator": self.name, "options": self.args.to_dict()}

    def _generate_batch(self, records: list[StoryRecord]) -> list[str]:
        """One story per record, in order; raise to fail the batch."""
        raise NotImplementedError

    def generate(
        self, records: Sequence[StoryRecord], progress: Callable[[int], Any] | None = None
    ) -> Generations:
        """Stories for ``records`` in batches of ``batch_size``. A batch that
        raises is retried record by record, so that only the records that
        fail are recorded as failures (with their error). ``progress(n)`` is
        called after each batch of n records."""
        self._setup()
        out = Generations()
        records = list(records)
        for start in range(0, len(records), self.args.batch_size):
            batch = records[start : start + self.args.batch_size]
            try:
                stories = self._generate_batch(batch)
                if len(stories) != len(batch):
                    raise RuntimeError(f"{self.name}: {len(stories)} stories for {len(batch)} records")
                results: list[str | BaseException] = list(stories)
            except Exception:
                results = [self._generate_one(record) for record in batch]
            for record, result in zip(batch, results):
                if isinstance(result, BaseException):
                    out.failures[record.story_id] = f"{type(result).__name__}: {result}"
                else:
                    out.stories[record.story_id] = result
            if progress is not None:
                progress(len(batch))
        if out.failures:
            log.warning("%s: %d of %d generations failed", self.name, len(out.failures), len(records))
        return out

    def _generate_one(self, record: StoryRecord) -> str | BaseException:
        try:
            (story,) = self._generate_batch([record])
            return story
        except Exception as exc:  # recorded as this record's failure
            return exc
