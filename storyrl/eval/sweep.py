"""Prompting sweeps: models × settings × prompts, every output scored and
compared with the human stories by d_HM (d_HM paper §4, Fig. 1, App. A).

:func:`run_sweep` runs a :class:`SweepConfig` (``storyrl sweep --config
configs/sweeps/<name>.yaml``) in three phases:

1. **Generation**, one model at a time (its weights load once and are
   released before the next model): every cell's stories go through
   :func:`storyrl.generators.runs.generate_to_file` into
   ``OUTPUT_DIR/cells/<model>/<setting>/<prompt>/stories.json`` and its
   sidecar. A generator without ``setting``/``prompt`` options (TAPM) has
   one cell, ``<model>/-/-``.
2. **Scoring** with the configured rewards (loaded once): the human stories
   once into ``OUTPUT_DIR/human_scores.csv`` (or a given table), each cell
   into its ``scores.csv``.
3. **d_HM** per cell (per dimension and overall) and the mean over prompts
   per model × setting, as the paper reports it: ``dhm.csv``, ``dhm.md`` and
   the bar chart ``dhm.png`` (:mod:`storyrl.eval.sweep_report`).

Resumable per cell: a cell whose sidecar says ``complete`` is not generated
again (its options are checked against the config), and score files are
resumed, so a finished cell costs nothing on a rerun and an interrupted one
continues where it stopped. A failed generation is counted, never scored.

Under ``accelerate launch`` (``WORLD_SIZE`` > 1) each process generates its
shard ``records[rank::world]`` of a cell into ``stories.rank<r>-of-<w>.json``;
the main process merges the shards (:func:`merge_shards`) and does all the
scoring while the others wait. A single-process cell that was interrupted is
not continued by a multi-process run (its shards start afresh).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.config import Config, option
from storyrl.data import StoryRecord
from storyrl.datasets import DATA_FORMATS, load_some_records
from storyrl.eval.sweep_shards import Processes, merge_shards, processes, shard_path

__all__ = ["Cell", "CellResult", "SweepConfig", "SweepModel", "SweepResult", "merge_shards", "plan_cells",
           "run_sweep", "shard_path"]

#: Setting / prompt label of a generator that has no such option (TAPM).
NONE = "-"
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")  # labels become directory names


@dataclass
class SweepModel(Config):
    """One model of a sweep."""

    name: str = option(help="Label in tables and plots, and the cell directory name.")
    generator: str = option("prompting", "Registered generator that runs the model (prompting, tapm, ...).")
    options: dict[str, Any] = option(factory=dict, help="Generator options (model, chat_format, ...); they win over "
                                     "the sweep's shared generation options.", cli=False)
    settings: list[str] | None = option(None, "This model's settings (default: the sweep's).", cli=False)
    prompts: list[str] | None = option(None, "This model's prompts (default: the sweep's).", cli=False)

    def _problems(self) -> list[str]:
        problems = []
        if not _LABEL.match(self.name):
            problems.append(f"name {self.name!r}: use letters, digits and ._+- (it names a directory)")
        problems += [f"options: set {key!r} with {key}s, not options" for key in ("setting", "prompt")
                     if key in self.options]
        return problems


@dataclass
class SweepConfig(Config):
    """A prompting sweep (``configs/sweeps/*.yaml``); see the module docs."""

    data: str = option(help="Stories with images: storyrl JSONL records, a VIST story-in-sequence JSON or the VWP "
                       "CSV; the human stories are the records' stories.", path="file")
    output_dir: str = option(help="Directory of the cells, score files and tables.")
    models: list[SweepModel] = option(help="The models: name, generator, options, settings, prompts.", cli=False)
    data_format: str = option("auto", "Format of data.", choices=DATA_FORMATS)
    image_root: str | None = option(None, "Directory that image ids and relative image paths are resolved in "
                                    "(given to generators and rewards that do not set their own).", path="dir")
    limit: int | None = option(None, "Only the first N stories of data.", min=1)
    settings: list[str] = option(factory=lambda: ["visual"], help="Settings of every model (unless it lists its own).",
                                 cli=False)
    prompts: list[str] = option(factory=lambda: ["P1", "P2", "P3"], help="Prompts of every model (unless it lists "
                                "its own); the d_HM table averages over them.", cli=False)
    generation: dict[str, Any] = option(factory=dict, help="Generator options shared by every model that declares "
                                        "them (max_new_tokens, batch_size, device, ...).", cli=False)
    rewards: dict[str, str | dict[str, Any]] = option(
        factory=dict, help="d_HM dimensions (groovist, coherence, repetition): a reward config file or its options.",
        cli=False)
    human_scores: str | None = option(None, "Precomputed score CSV of the human stories (default: scored here).",
                                      path="file")
    score_batch_size: int = option(64, "Stories per scoring batch.", min=1)

    def __post_init__(self) -> None:
        # Built here, not by the generic nested-config path, so that an error names models[i].
        if isinstance(self.models, list):
            self.models = [_model(m, i) for i, m in enumerate(self.models)]
        super().__post_init__()

    def _problems(self) -> list[str]:
        from storyrl.eval.dhm import DHM_DIMENSIONS

        problems = []
        if not self.models:
            problems.append("models: give at least one model")
        names = [m.name for m in self.models]
        problems += [f"models: name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        for key, values in (("settings", self.settings), ("prompts", self.prompts)):
            if not values or len(set(values)) != len(values) or not all(map(_LABEL.match, values)):
                problems.append(f"{key}: a non-empty list of distinct names, got {values!r}")
        if not self.rewards:
            problems.append(f"rewards: give at least one d_HM dimension ({', '.join(DHM_DIMENSIONS)})")
        for key, value in self.rewards.items():
            if key not in DHM_DIMENSIONS:
                problems.append(f"rewards: {key!r} is not a d_HM dimension; use {', '.join(DHM_DIMENSIONS)}")
            elif isinstance(value, str) and not Path(value).is_file():
                problems.append(f"rewards.{key}: no such reward config file {value}")
            elif isinstance(value, dict):
                problems += [f"rewards.{key}: {p}" for p in _reward_option_problems(key, value)]
        if not problems:
            problems += _cell_problems(self)
        return problems

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> SweepConfig:
        config = super().from_yaml(path, **overrides)
        config.source = str(path)  # later errors (a reward that fails to load) name the file too
        return config


def _model(value: Any, index: int) -> Any:
    if isinstance(value, SweepModel) or not isinstance(value, dict):
        return value  # the type check reports a non-mapping
    try:
        return SweepModel.from_mapping(value)
    except (TypeError, ValueError) as exc:
        name = value.get("name")
        raise type(exc)(f"models[{index}]{f' ({name})' if isinstance(name, str) else ''}: {exc}") from None


def _reward_option_problems(name: str, options: dict) -> list[str]:
    from storyrl.rewards import REWARDS

    try:
        REWARDS.get(name).config_class.from_mapping(options)
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    return []


# -- cells ----------------------------------------------------------------------


@dataclass
class Cell:
    """One model × setting × prompt of a sweep and its files."""

    model: str
    setting: str
    prompt: str
    generator: str
    #: the generator's options, setting and prompt included
    options: dict[str, Any]
    directory: Path

    @property
    def label(self) -> str:
        return f"{self.model}/{self.setting}/{self.prompt}"

    @property
    def stories(self) -> Path:
        return self.directory / "stories.json"

    @property
    def scores(self) -> Path:
        return self.directory / "scores.csv"


def plan_cells(config: SweepConfig) -> list[Cell]:
    """The sweep's cells in model, setting, prompt order."""
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    cells = []
    for model in config.models:
        declared = {info.name for info in option_info(GENERATORS.get(model.generator).config_class)}
        options = {k: v for k, v in config.generation.items() if k in declared}
        if "image_root" in declared and config.image_root is not None:
            options["image_root"] = config.image_root
        options.update(model.options)
        settings = (model.settings or config.settings) if "setting" in declared else [NONE]
        prompts = (model.prompts or config.prompts) if "prompt" in declared else [NONE]
        for setting in settings:
            for prompt in prompts:
                given = {k: v for k, v in (("setting", setting), ("prompt", prompt)) if v != NONE}
                cells.append(Cell(model.name, setting, prompt, model.generator, {**options, **given},
                                  Path(config.output_dir) / "cells" / model.name / setting / prompt))
    return cells


def _cell_problems(config: SweepConfig) -> list[str]:
    """Every cell's generator options checked now (cheap: no model loads),
    so that a typo fails before hours of generation."""
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    problems, declared = [], set()
    for index, model in enumerate(config.models):
        if model.generator not in GENERATORS:
            problems.append(f"models[{index}] ({model.name}): unknown generator {model.generator!r}; "
                            f"choose from {', '.join(GENERATORS.names())}")
            continue
        declared |= {info.name for info in option_info(GENERATORS.get(model.generator).config_class)}
    if problems:
        return problems
    unknown = sorted(set(config.generation) - declared)
    if unknown:
        problems.append(f"generation: no model's generator has option(s) {', '.join(unknown)}")
    checked = set()
    for cell in plan_cells(config):
        if cell.model in checked:
            continue
        try:
            _generator_config(cell)
        except (TypeError, ValueError) as exc:
            index = next(i for i, m in enumerate(config.models) if m.name == cell.model)
            problems.append(f"models[{index}] ({cell.model}), cell {cell.setting}/{cell.prompt}: {exc}")
            checked.add(cell.model)  # one problem per model is enough
    return problems


def _generator_config(cell: Cell) -> Config:
    from storyrl.generators import GENERATORS

    config = GENERATORS.get(cell.generator).config_class.from_mapping(cell.options)
    if callable(getattr(config, "template", None)):
        config.template()  # the prompt exists in the prompts file
    return config


def _sidecar(cell: Cell) -> dict | None:
    from storyrl.generators.runs import sidecar_path

    try:
        meta = json.loads(sidecar_path(cell.stories).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _generated(cell: Cell, ids: Sequence[str]) -> bool:
    """The cell's stories are complete for these records, with the cell's
    options (a changed option is an error, not a silent reuse)."""
    from storyrl.generators import GENERATORS
    from storyrl.generators.runs import check_same_options, pair_is_whole, sidecar_path

    meta = _sidecar(cell)
    if not meta or meta.get("complete") is not True or not cell.stories.is_file():
        return False
    text = cell.stories.read_text(encoding="utf-8")
    if not pair_is_whole(meta, text):
        return False  # killed between the sidecar and the story file: generate_to_file resumes it
    cls = GENERATORS.get(cell.generator)
    now = {"generator": cls.name or cell.generator, "options": _generator_config(cell).to_dict()}
    check_same_options(sidecar_path(cell.stories), meta, now, getattr(cls.config_class, "runtime_options", ()),
                       remedy=f"use another output_dir, or delete {cell.directory} to redo the cell")
    stories = json.loads(text)
    return all(sid in stories or sid in meta.get("failures", {}) for sid in ids)


def _generate_cells(cells: list[Cell], records: list[StoryRecord], procs: Processes, progress: bool,
                    inputs: dict) -> None:
    from storyrl.generators import create_generator
    from storyrl.generators.runs import generate_to_file

    ids = [r.story_id for r in records]
    for model in dict.fromkeys(c.model for c in cells):
        todo = [c for c in cells if c.model == model and not _generated(c, ids)]
        for cell in todo:
            if progress and procs.main:
                print(f"sweep: generating {cell.label}", file=sys.stderr)
            options = dict(cell.options)
            if procs.world > 1 and "device" in _declared(cell) and options.get("device") is None:
                options["device"] = procs.device  # each process on its own GPU
            generator = create_generator(cell.generator, **options)
            if procs.world == 1:
                generate_to_file(generator, records, cell.stories, resume=True, progress=progress, inputs=inputs)
            else:
                shard = shard_path(cell.stories, procs.rank, procs.world)
                generate_to_file(generator, records[procs.rank :: procs.world], shard, resume=True,
                                 progress=progress and procs.main, inputs=inputs)
                procs.wait()
                if procs.main:
                    merge_shards(cell.stories, [shard_path(cell.stories, r, procs.world) for r in range(procs.world)],
                                 records)
            del generator
        if todo:  # the model just used, before the next one loads
            from storyrl.models import release_models
            from storyrl.models.runtime import free_memory

            release_models()
            free_memory()


def _declared(cell: Cell) -> set[str]:
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    return {info.name for info in option_info(GENERATORS.get(cell.generator).config_class)}


# -- scoring and d_HM -------------------------------------------------------------------


def _make_rewards(config: SweepConfig, source: str) -> list:
    """One reward per d_HM dimension (models not loaded yet)."""
    from storyrl.config import option_info
    from storyrl.rewards import create_reward, load_reward_config

    rewards = []
    for key, value in config.rewards.items():
        try:
            if isinstance(value, str):
                reward = load_reward_config(value)
                declared = {info.name for info in option_info(type(reward).config_class)}
                if "image_root" in declared and reward.args.image_root is None and config.image_root:
                    reward = load_reward_config(value, overrides={"image_root": config.image_root})
            else:
                declared = {info.name for info in option_info(type(create_reward(key, **value)).config_class)}
                extra = {"image_root": config.image_root} if "image_root" in declared and config.image_root else {}
                reward = create_reward(key, **{**extra, **value})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: rewards.{key}: {exc}") from None
        if reward.name != key:
            raise ValueError(f"{source}: rewards.{key}: the config is a {reward.name!r} reward, not {key!r}")
        rewards.append(reward)
    return rewards


def prepare_sweep_rewards(rewards: list, records: Sequence[StoryRecord], progress: bool) -> dict:
    """The rewards' image side embedded once for every record before any
    scoring (:meth:`storyrl.rewards.base.Reward.prepare`), so that the cells'
    scoring is text work only."""
    from storyrl.rewards.base import prepare_rewards

    images = [r.images or None for r in records]
    ids = [r.image_ids or None for r in records]
    context = {"images": images if any(images) else None, "image_ids": ids if any(ids) else None}
    if progress and any(getattr(r, "prepare", None) for r in rewards):
        print("sweep: embedding the images", file=sys.stderr)
    return prepare_rewards(rewards, context, progress=progress)


@dataclass
class CellResult:
    """A cell's (or, with prompt ``mean``, a model × setting's) d_HM row."""

    model: str
    setting: str
    prompt: str
    records: int
    #: stories generated (failures are not)
    stories: int
    failures: int
    #: generated stories left out because a score (theirs or the human's) is missing or NaN
    unscorable: int
    #: stories counted in d_HM
    n: int
    distances: dict[str, float]
    d_hm: float
    #: prompts averaged (mean rows)
    prompts: int = 1


@dataclass
class SweepResult:
    cells: list[CellResult]
    means: list[CellResult]
    paths: dict[str, Path] = field(default_factory=dict)
    markdown: str = ""


def _mean_rows(cells: list[CellResult], dimensions: list[str]) -> list[CellResult]:
    """Mean over prompts per model × setting, of the prompts with a d_HM (the paper's averaging)."""
    means = []
    for key in dict.fromkeys((c.model, c.setting) for c in cells):
        group = [c for c in cells if (c.model, c.setting) == key]
        ok = [c for c in group if math.isfinite(c.d_hm)]

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else math.nan

        means.append(CellResult(
            *key, "mean", sum(c.records for c in group), sum(c.stories for c in group),
            sum(c.failures for c in group), sum(c.unscorable for c in group), sum(c.n for c in group),
            {d: mean([c.distances[d] for c in ok]) for d in dimensions}, mean([c.d_hm for c in ok]), len(ok)))
    return means


def run_sweep(config: SweepConfig, progress: bool = True) -> SweepResult | None:
    """Run the sweep (module docs). Returns the d_HM rows and output paths;
    ``None`` in the non-main processes of a multi-process run."""
    from storyrl.data import read_scores
    from storyrl.eval.dhm import DHM_DIMENSIONS, dhm
    from storyrl.eval.scoring import score_to_file
    from storyrl.eval.sweep_report import write_report

    source = getattr(config, "source", None) or "sweep config"
    records = load_some_records(config.data, config.data_format, config.limit)
    ids = [r.story_id for r in records]
    id_set = set(ids)
    cells = plan_cells(config)
    rewards = _make_rewards(config, source)  # a bad reward config fails before any generation
    metrics = [m for m in DHM_DIMENSIONS if m in config.rewards]
    out = Path(config.output_dir)
    procs = processes()
    _generate_cells(cells, records, procs, progress, {"data": str(config.data), "limit": config.limit,
                                                      "sweep": source})
    if not procs.main:
        procs.wait()  # the main process scores and writes the tables
        return None
    try:
        prepare_sweep_rewards(rewards, records, progress)
        if config.human_scores is not None:
            human = read_scores(config.human_scores, require=metrics)
        else:
            if not any(r.story.strip() for r in records):
                raise ValueError(f"{config.data}: the records have no human stories; give human_scores")
            if progress:
                print("sweep: scoring the human stories", file=sys.stderr)
            score_to_file(rewards, records, out / "human_scores.csv", resume=True,
                          batch_size=config.score_batch_size, progress=progress)
            human = read_scores(out / "human_scores.csv")
        human = human.restricted(ids)
        results = []
        for cell in cells:
            stories = json.loads(cell.stories.read_text(encoding="utf-8"))
            meta = _sidecar(cell) or {}
            generated = [StoryRecord(r.story_id, stories[r.story_id], images=r.images, image_ids=r.image_ids)
                         for r in records if r.story_id in stories]
            if progress:
                print(f"sweep: scoring {cell.label}", file=sys.stderr)
            score_to_file(rewards, generated, cell.scores, resume=True, batch_size=config.score_batch_size,
                          progress=progress)
            result = dhm(human, read_scores(cell.scores).restricted(ids), metrics)
            failures = sum(1 for sid in meta.get("failures", {}) if sid in id_set)
            results.append(CellResult(cell.model, cell.setting, cell.prompt, len(records), len(generated), failures,
                                      len(generated) - result.n, result.n, result.distances, result.d_hm))
        dims = [DHM_DIMENSIONS[m][0] for m in metrics]
        sweep = SweepResult(results, _mean_rows(results, dims))
        sweep.paths, sweep.markdown = write_report(sweep, out, dims)
    finally:
        procs.wait()
    return sweep
