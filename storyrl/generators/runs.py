"""A generation run written to disk: the story file and its sidecar.

:func:`generate_to_file` writes ``OUT`` (JSON ``{story_id: story}``, the
story set ``storyrl score`` reads) and ``OUT``'s sidecar
(``stories.json`` → ``stories.meta.json``): generator, options, model
revision, prompt text, decoding parameters, counts and the failed stories
with their errors. Both are rewritten atomically after every batch, under a
lock held for the whole run, so a kill leaves every finished batch on disk
and a second process cannot write the same files. ``resume=True`` keeps the
stories already in ``OUT`` and generates the rest (failed ones again); it
refuses a file made with different generation options or from another data
file (the sidecar records the data file's path and SHA-256).

The pair is written sidecar first: the sidecar records the SHA-256 of the
story file it goes with (``stories_sha256``), then the story file is
replaced. A kill between the two leaves the new sidecar with the old story
file; the sidecar's options are still those the old stories were made with
(a run with other options is refused before anything is written), so
``resume`` detects the mismatch, keeps the stories the file holds and
rewrites both; :func:`pair_is_whole` tells a reader (a sweep) whether the
two belong together.
"""

from __future__ import annotations

import hashlib
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

__all__ = ["GenerationRun", "check_same_data", "check_same_options", "check_sidecar", "file_sha256",
           "generate_to_file", "pair_is_whole", "sidecar_path", "text_sha256"]


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


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pair_is_whole(meta: dict, story_text: str) -> bool:
    """Whether ``story_text`` is the story file the sidecar ``meta`` was
    written with (True for a sidecar from before digests were recorded)."""
    want = meta.get("stories_sha256")
    return want is None or want == text_sha256(story_text)


#: sidecar keys and the JSON types they must have when present
_SIDECAR_TYPES = {"generator": str, "options": dict, "inputs": dict, "failures": dict, "counts": dict,
                  "stories_sha256": str, "complete": bool}


def check_sidecar(meta_path: Path, meta: Any, remedy: str | None = None) -> dict:
    """``meta`` if it has the shape of a sidecar storyrl writes, else a
    one-line ValueError naming ``meta_path`` (ending with ``remedy``, what
    to do, when given)."""
    then = f"; {remedy}" if remedy else ""
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: not a sidecar storyrl wrote (expected a JSON object){then}")
    for key, kind in _SIDECAR_TYPES.items():
        if key in meta and not isinstance(meta[key], kind):
            raise ValueError(f"{meta_path}: not a sidecar storyrl wrote ({key!r} must be a JSON "
                             f"{'object' if kind is dict else kind.__name__}, got {_json_type(meta[key])}){then}")
    return meta


def _json_type(value: Any) -> str:
    return {type(None): "null", list: "list", dict: "object", str: "string", bool: "boolean"}.get(
        type(value), "number")


def check_same_data(meta_path: Path, before: dict, inputs: dict) -> None:
    """ValueError when the sidecar ``before`` records another data file than
    ``inputs`` (by SHA-256 where both have one, else by path)."""
    old, new = before.get("inputs") or {}, inputs or {}
    if not isinstance(old, dict) or old.get("data") is None or new.get("data") is None:
        return
    old_sha, new_sha = old.get("data_sha256"), new.get("data_sha256")
    same = old_sha == new_sha if old_sha and new_sha else old["data"] == new["data"]
    if not same:
        def name(entry: dict) -> str:
            sha = entry.get("data_sha256")
            return f"{entry['data']}" + (f" (sha256 {sha[:12]})" if isinstance(sha, str) else "")

        raise ValueError(f"{meta_path}: the stories were generated from {name(old)}, this run reads {name(new)}; "
                         f"use the same data, another output file or --overwrite")


def check_same_options(meta_path: Path, before: dict, now: dict, runtime: Sequence[str],
                       remedy: str | None = None) -> None:
    """ValueError unless the sidecar ``before`` was written by the same
    generator with the same options as ``now`` (``runtime`` ones may differ).
    ``remedy``: what the error tells the user to do (default: another output
    file or --overwrite, and nothing for a malformed sidecar)."""
    check_sidecar(meta_path, before, remedy)
    remedy = remedy or "use another output file or --overwrite"
    if before.get("generator") != now["generator"]:
        raise ValueError(f"{meta_path}: written by generator {before.get('generator')!r}, this run is "
                         f"{now['generator']!r}; {remedy}")
    old, new = before.get("options", {}), now["options"]
    for key in sorted(set(old) | set(new)):
        if key not in runtime and old.get(key) != new.get(key):
            raise ValueError(f"{meta_path}: the stories were generated with {key}={old.get(key)!r}, this run has "
                             f"{key}={new.get(key)!r}; {remedy}")


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
    from storyrl.console import progress as progress_bar

    from storyrl.output_files import LockedOutput

    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    out = Path(out)
    ids = [r.story_id for r in records]
    check_story_ids(ids, out)
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"story {dup!r} appears twice in the records")
    inputs = dict(inputs or {})
    if inputs.get("data") is not None and "data_sha256" not in inputs and Path(inputs["data"]).is_file():
        inputs["data_sha256"] = file_sha256(inputs["data"])
    generator.setup()  # models load before any file is touched
    meta = {"generator": generator.name, **generator.metadata(), "inputs": inputs}
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
                check_same_data(run.sidecar, before, inputs)
                text, partial = story_file.read()
                if not pair_is_whole(before, text + partial) and progress:
                    # killed between writing the sidecar and the story file (module docs)
                    print(f"{out}: older than its sidecar (an interrupted write); keeping its "
                          f"{len(previous)} stories", file=sys.stderr)
            run.stories = {k: v for k, v in previous.items() if isinstance(v, str)}
            run.resumed = len(run.stories)
        todo = [r for r in records if r.story_id not in run.stories]
        if run.resumed and progress:
            print(f"resuming {out}: {run.resumed} stories already generated, {len(todo)} to go", file=sys.stderr)
        order = {sid: i for i, sid in enumerate(ids)}
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")

        def save(complete: bool) -> None:
            stories = dict(sorted(run.stories.items(), key=lambda kv: order.get(kv[0], len(order))))
            text = json.dumps(stories, indent=1, ensure_ascii=False) + "\n"
            # Sidecar first, recording the story file it goes with (module docs).
            meta_file.replace(json.dumps({
                **meta, "started": started, "complete": complete,
                "counts": {"records": len(records), "stories": len(run.stories), "failures": len(run.failures)},
                "failures": run.failures, "stories_sha256": text_sha256(text),
            }, indent=1, ensure_ascii=False) + "\n")
            story_file.replace(text)

        size = generator.args.batch_size
        with progress_bar(total=len(todo), unit="story", disable=not progress, file=sys.stderr) as bar:
            for start in range(0, len(todo), size):
                batch = todo[start : start + size]
                result = generator.generate(batch)
                run.stories.update(result.stories)
                run.failures.update(result.failures)
                save(complete=False)
                bar.update(len(batch))
        save(complete=True)
    return run
