"""A generation run written to disk: the story file and its sidecar.

:func:`generate_to_file` writes ``OUT`` (JSON ``{story_id: story}``, the
story set ``storyrl score`` reads) and ``OUT``'s sidecar
(``stories.json`` → ``stories.meta.json``): generator, options, model
revision, prompt text, decoding parameters, counts and the failed stories
with their errors. Both are rewritten atomically after every batch, under a
lock held for the whole run, so a kill leaves every finished batch on disk
and a second process cannot write the same files. ``resume=True`` keeps the
stories already in ``OUT`` and generates the rest (failed ones again); it
refuses a file made with different generation options.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.data import StoryRecord, check_story_ids
from storyrl.generators.base import Generator

__all__ = ["GenerationRun", "check_same_options", "generate_to_file", "sidecar_path"]


def sidecar_path(out: str | os.PathLike) -> Path:
    """``stories.json`` → ``stories.meta.json``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.meta.json")


@dataclass
class GenerationRun:
    """What :func:`generate_to_file` left on disk."""

    out: Path
    sidecar: Path
    stories: dict[str, str] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    #: stories kept from an earlier run (resume)
    resumed: int = 0


def _read_json(locked, what: str) -> dict | None:
    text, partial = locked.read()
    text += partial
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{locked.path}: not a {what} storyrl wrote ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{locked.path}: not a {what} storyrl wrote (expected a JSON object)")
    return data


def check_same_options(meta_path: Path, before: dict, now: dict, runtime: Sequence[str]) -> None:
    """ValueError unless the sidecar ``before`` was written by the same
    generator with the same options as ``now`` (``runtime`` ones may differ)."""
    if before.get("generator") != now["generator"]:
        raise ValueError(f"{meta_path}: written by generator {before.get('generator')!r}, this run is "
                         f"{now['generator']!r}; use another output file or --overwrite")
    old, new = before.get("options", {}), now["options"]
    for key in sorted(set(old) | set(new)):
        if key not in runtime and old.get(key) != new.get(key):
            raise ValueError(f"{meta_path}: the stories were generated with {key}={old.get(key)!r}, this run has "
                             f"{key}={new.get(key)!r}; use another output file or --overwrite")


def generate_to_file(
    generator: Generator,
    records: Sequence[StoryRecord],
    out: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    inputs: dict[str, Any] | None = None,
) -> GenerationRun:
    """Generate stories for ``records`` into ``out`` and its sidecar (module
    docs). ``inputs`` (e.g. the data file) is recorded in the sidecar."""
    from tqdm import tqdm

    from storyrl.output_files import LockedOutput

    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    out = Path(out)
    ids = [r.story_id for r in records]
    check_story_ids(ids, out)
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"story {dup!r} appears twice in the records")
    generator.setup()  # models load before any file is touched
    meta = {"generator": generator.name, **generator.metadata(), "inputs": inputs or {}}
    runtime = getattr(generator.config_class, "runtime_options", ())
    existing = "keep" if resume else "truncate" if overwrite else "refuse"
    run = GenerationRun(out, sidecar_path(out))
    with LockedOutput(out, existing) as story_file, LockedOutput(run.sidecar, existing) as meta_file:
        if resume:
            previous = _read_json(story_file, "story file") or {}
            before = _read_json(meta_file, "sidecar")
            if previous and before is None:
                raise ValueError(f"{run.sidecar}: missing; cannot tell how {out} was generated")
            if before is not None:
                check_same_options(run.sidecar, before, meta, runtime)
            run.stories = {k: v for k, v in previous.items() if isinstance(v, str)}
            run.resumed = len(run.stories)
        todo = [r for r in records if r.story_id not in run.stories]
        if run.resumed and progress:
            print(f"resuming {out}: {run.resumed} stories already generated, {len(todo)} to go", file=sys.stderr)
        order = {sid: i for i, sid in enumerate(ids)}
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

        def save(complete: bool) -> None:
            stories = dict(sorted(run.stories.items(), key=lambda kv: order.get(kv[0], len(order))))
            story_file.replace(json.dumps(stories, indent=1, ensure_ascii=False) + "\n")
            meta_file.replace(json.dumps({
                **meta, "started": started, "complete": complete,
                "counts": {"records": len(records), "stories": len(run.stories), "failures": len(run.failures)},
                "failures": run.failures,
            }, indent=1, ensure_ascii=False) + "\n")

        size = generator.args.batch_size
        with tqdm(total=len(todo), unit="story", disable=not progress, file=sys.stderr) as bar:
            for start in range(0, len(todo), size):
                batch = todo[start : start + size]
                result = generator.generate(batch)
                run.stories.update(result.stories)
                run.failures.update(result.failures)
                save(complete=False)
                bar.update(len(batch))
        save(complete=True)
    return run
