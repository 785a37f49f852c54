"""Running a sweep across processes (:mod:`storyrl.eval.sweep`): under
``accelerate launch`` (``WORLD_SIZE`` > 1) each process generates its shard
``records[rank::world]`` of a cell into ``stories.rank<r>-of-<w>.json``
(:func:`shard_path`) and the main process merges the shards into the cell's
story file and sidecar (:func:`merge_shards`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from storyrl.data import StoryRecord

__all__ = ["Processes", "merge_shards", "processes", "shard_path"]


@dataclass
class Processes:
    """This process's rank, the process count, the barrier and (several processes) its device."""

    rank: int = 0
    world: int = 1
    wait: Callable[[], None] = lambda: None
    device: str | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0


def processes() -> Processes:
    """This process's place under ``accelerate launch`` (one process: no accelerate)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Processes()
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # Without CUDA (or under accelerate launch --cpu) accelerate needs cpu=True to see the processes.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    if state.num_processes != world:  # each process would write every cell: refuse
        raise ValueError(f"WORLD_SIZE is {world} but accelerate sees {state.num_processes} process(es); "
                         "launch with accelerate launch")
    return Processes(state.process_index, state.num_processes, state.wait_for_everyone, str(state.device))


def shard_path(out: str | os.PathLike, rank: int, world: int) -> Path:
    """``stories.json`` → ``stories.rank<rank>-of-<world>.json``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.rank{rank}-of-{world}{out.suffix}")


def merge_shards(out: str | os.PathLike, shards: Sequence[str | os.PathLike], records: Sequence[StoryRecord]) -> dict:
    """Merge finished per-process story files (and sidecars) into ``out``
    and its sidecar, stories in record order, then remove the shards.
    Every record must be in exactly one shard, as a story or a failure.
    Returns the merged sidecar."""
    from storyrl.generators.runs import sidecar_path, text_sha256
    from storyrl.output_files import replace_file

    stories: dict[str, str] = {}
    failures: dict[str, str] = {}
    metas = []
    for shard in map(Path, shards):
        try:
            meta = json.loads(sidecar_path(shard).read_text(encoding="utf-8"))
            part = json.loads(shard.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{shard}: cannot read the shard or its sidecar: {exc}") from None
        if not meta.get("complete"):
            raise ValueError(f"{shard}: shard is not complete; run the sweep again to finish it")
        for sid in (*part, *meta.get("failures", {})):
            if sid in stories or sid in failures:
                raise ValueError(f"{shard}: story {sid!r} is also in another shard")
        stories.update(part)
        failures.update(meta.get("failures", {}))
        metas.append(meta)
    ids = [r.story_id for r in records]
    missing = [sid for sid in ids if sid not in stories and sid not in failures]
    if missing:
        raise ValueError(f"{out}: the shards miss story {missing[0]!r} ({len(missing)} missing)")
    merged = {sid: stories[sid] for sid in ids if sid in stories}
    failed = {sid: failures[sid] for sid in ids if sid in failures}
    text = json.dumps(merged, indent=1, ensure_ascii=False) + "\n"
    meta = {**metas[0], "complete": True, "shards": len(metas),
            "counts": {"records": len(ids), "stories": len(merged), "failures": len(failed)}, "failures": failed,
            "stories_sha256": text_sha256(text)}
    # Stories first, then the sidecar that says "complete": a kill between
    # the two leaves an incomplete cell, which the next run merges again.
    replace_file(out, text, overwrite=True)
    replace_file(sidecar_path(out), json.dumps(meta, indent=1, ensure_ascii=False) + "\n", overwrite=True)
    for shard in map(Path, shards):
        shard.unlink(missing_ok=True)
        sidecar_path(shard).unlink(missing_ok=True)
    return meta
