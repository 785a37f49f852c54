"""Reward ablations: the same RL training with each reward variant, every
resulting policy evaluated on the same held-out sequences with the full
metric suite and d_HM against the human stories (issue 11 part 4).

:func:`run_ablation` runs an :class:`AblationConfig` (``storyrl ablate
--config configs/ablations/<name>.yaml``). Per variant, under
``OUTPUT_DIR/variants/<name>/``:

1. **Training** (``train/``): the base RL config (``train``) with the
   variant's reward options (``rewards``, ``reward_weights``, ...) through
   :func:`storyrl.training.rl.train.train`; the policy lands in
   ``train/final/``.
2. **Generation**: greedy stories of the trained policy for the held-out
   sequences (``eval.data``) through
   :func:`storyrl.training.rl.policy.generate_stories`, written as
   ``storyrl generate`` writes them (``stories.json`` and its sidecar).
3. **Scoring** with every metric (``scores.csv``); the human stories (the
   records' reference, else their story) are scored once for all variants
   (``OUTPUT_DIR/human_scores.csv``).

Instead of training, ``stories: {variant: story_file}`` evaluates fixed
story files (``{story_id: story}``), e.g. policies trained elsewhere.

The table (:mod:`storyrl.eval.ablation_report`): per variant the counts, the
mean of each metric, the d_HM distance per dimension and d_HM.

Finished work is never redone: a trained variant is not trained again,
complete stories are not regenerated, score files are resumed, so a rerun
only rebuilds the table and an interrupted one continues (training from its
last checkpoint). What identifies a variant -- its training config, or its
story file's content -- is recorded in ``variant.json``, and the metrics'
options in ``OUTPUT_DIR/metrics.json``: a variant or a metric changed since
it ran is an error, not a silent reuse; ``overwrite=True`` redoes it instead
(the variant's directory is replaced; changed metrics rescore every table).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from storyrl.config import Config, load_yaml, option
from storyrl.data import ScoreTable, StoryRecord
from storyrl.eval.ablation_report import HUMAN, AblationResult, VariantResult, write_ablation_report
from storyrl.generators.base import Generations, Generator, GeneratorConfig

__all__ = ["AblationConfig", "AblationEval", "AblationResult", "PolicyGenerator", "Variant", "VariantResult",
           "plan_variants", "run_ablation"]

_DATA_FORMATS = ("auto", "records", "vist-sis", "vwp")  # storyrl.datasets.DATA_FORMATS
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")  # labels become directory names
#: Variants change only the reward: RL options whose name says so (rewards, reward_weights, ...).
_REWARD_OPTION = re.compile(r"reward")


@dataclass
class AblationEval(Config):
    """The held-out evaluation every variant gets."""

    data: str = option(help="Held-out sequences with their human stories: storyrl JSON/JSONL records, a VIST "
                       "story-in-sequence JSON or the VWP CSV.", path="file")
    metrics: list[str | dict[str, Any]] = option(
        help="Metrics to score every story with: a reward config file, a reward name, or {reward: name, ...}.",
        cli=False)
    data_format: str = option("auto", "Format of data.", choices=_DATA_FORMATS)
    image_root: str | None = option(None, "Directory that image ids and relative image paths are resolved in.",
                                    path="dir")
    dimensions: list[str] | None = option(None, "d_HM dimensions (groovist, coherence, repetition); default: "
                                          "every one among the metrics.", cli=False)
    human_scores: str | None = option(None, "Precomputed score CSV of the human stories (default: scored here).",
                                      path="file")
    max_stories: int | None = option(None, "Only the first N sequences of data.", min=1)
    batch_size: int = option(64, "Stories per scoring batch.", min=1)
    generation_batch_size: int = option(8, "Sequences per generation batch of a trained policy.", min=1)
    save_every: int = option(256, "Sequences per policy load and story-file save while generating (a killed "
                             "run keeps every saved part).", min=1)

    def _problems(self) -> list[str]:
        from storyrl.eval.dhm import DHM_DIMENSIONS

        problems, names = [], []
        if not self.metrics:
            problems.append("metrics: give at least one metric")
        for index, spec in enumerate(self.metrics):
            try:
                names.append(_metric(spec, self.image_root).name)
            except (TypeError, ValueError) as exc:
                problems.append(f"metrics[{index}]: {exc}")
        problems += [f"metrics: {n!r} is given twice" for n in sorted({n for n in names if names.count(n) > 1})]
        for dim in self.dimensions or ():
            if dim not in DHM_DIMENSIONS:
                problems.append(f"dimensions: {dim!r} is not a d_HM dimension; use {', '.join(DHM_DIMENSIONS)}")
            elif names and dim not in names:
                problems.append(f"dimensions: {dim!r} is not among the metrics ({', '.join(names)})")
        if self.dimensions is not None and (not self.dimensions or len(set(self.dimensions)) != len(self.dimensions)):
            problems.append(f"dimensions: a non-empty list of distinct dimensions, got {self.dimensions!r}")
        if self.dimensions is None and names and not any(n in DHM_DIMENSIONS for n in names):
            problems.append(f"metrics: no d_HM dimension among them; add {', '.join(DHM_DIMENSIONS)}")
        return problems

    def dims(self) -> list[str]:
        """The d_HM dimensions, in d_HM's order."""
        from storyrl.eval.dhm import DHM_DIMENSIONS

        names = {_metric(spec, self.image_root).name for spec in self.metrics}
        chosen = self.dimensions if self.dimensions is not None else names
        return [d for d in DHM_DIMENSIONS if d in chosen]


@dataclass
class AblationConfig(Config):
    """A reward ablation (``configs/ablations/*.yaml``); see the module docs."""

    output_dir: str = option(help="Directory of the variants, score files and tables.")
    eval: AblationEval = option(help="Held-out data, metrics, d_HM dimensions, batch sizes.", cli=False)
    train: str | dict[str, Any] | None = option(
        None, "Base RL config of every variant: a configs/rl/*.yaml file or its options.", cli=False)
    variants: dict[str, dict[str, Any]] = option(
        factory=dict, help="Variant name -> the RL config's reward options it sets (rewards, reward_weights).",
        cli=False)
    stories: dict[str, str] = option(
        factory=dict, help="Instead of training: variant name -> a story file {story_id: story} to evaluate.",
        cli=False)

    def __post_init__(self) -> None:
        # Built here, not by the generic nested path, so that errors say eval.<key>.
        if isinstance(self.eval, dict):
            try:
                self.eval = AblationEval.from_mapping(self.eval)
            except (TypeError, ValueError) as exc:
                prefix = f"{AblationEval._label()}: "
                message = str(exc)[len(prefix):] if str(exc).startswith(prefix) else str(exc)
                raise type(exc)(f"eval: {message}") from None
        super().__post_init__()

    def _problems(self) -> list[str]:
        problems = []
        if bool(self.variants) == bool(self.stories):
            problems.append("give either variants (trained from train) or stories (fixed story files), not both"
                            if self.variants else "give variants (with train) or stories")
        if self.variants and self.train is None:
            problems.append("variants: give train, the base RL config every variant trains with")
        if self.stories and self.train is not None:
            problems.append("train: fixed story files (stories) are not trained; drop train or use variants")
        for key, names in (("variants", self.variants), ("stories", self.stories)):
            for name in names:
                if not _LABEL.match(name):
                    problems.append(f"{key}: name {name!r}: use letters, digits and ._+- (it names a directory)")
                elif name == HUMAN:
                    problems.append(f"{key}: {HUMAN!r} names the human stories' row; choose another name")
        if problems or not self.variants:
            return problems
        if isinstance(self.train, str) and not Path(self.train).is_file():
            return [f"train: no such RL config file {self.train}"]
        try:
            base = _base_train(self)
        except ValueError as exc:
            return [f"train: {exc}"]
        failed = {}
        for name, overrides in self.variants.items():
            bad = [key for key in overrides if not _REWARD_OPTION.search(key)]
            if bad:
                problems.append(f"variants.{name}: {', '.join(map(repr, bad))} is not a reward option; a variant "
                                "changes only the reward (rewards, reward_weights), every variant trains alike")
                continue
            try:
                _rl_config({**base, **overrides}, Path(self.output_dir) / "variants" / name / "train")
            except (TypeError, ValueError, ImportError) as exc:
                failed[name] = str(exc)
        if len(failed) > 1 and len(set(failed.values())) == 1:  # the base's fault: said once
            return [*problems, f"train (every variant): {next(iter(failed.values()))}"]
        return problems + [f"variants.{name}: {message}" for name, message in failed.items()]

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> AblationConfig:
        config = super().from_yaml(path, **overrides)
        config.source = str(path)  # later errors name the file too
        return config


def _metric(spec: Any, image_root: str | None) -> Any:
    from storyrl.eval.scoring import make_metric

    return make_metric(spec, image_root)


def _base_train(config: AblationConfig) -> dict[str, Any]:
    if isinstance(config.train, dict):
        return dict(config.train)
    data = load_yaml(config.train)
    if not isinstance(data, dict):
        raise ValueError(f"{config.train}: expected a YAML mapping of RL options")
    return data


def _rl_config(options: dict[str, Any], train_dir: Path) -> Any:
    """The variant's RLConfig (options checked; nothing loads)."""
    from storyrl.training.rl.config import RLConfig

    return RLConfig.from_mapping({**options, "output_dir": str(train_dir)})


# -- variants -----------------------------------------------------------------


@dataclass
class Variant:
    """One variant of an ablation and its files."""

    name: str
    directory: Path
    #: what identifies the variant: its training options, or its story file's content
    definition: dict[str, Any]
    #: the training options (training mode)
    train_options: dict[str, Any] | None = None
    #: the fixed story file (stories mode)
    story_file: Path | None = None

    @property
    def train_dir(self) -> Path:
        return self.directory / "train"

    @property
    def stories(self) -> Path:
        return self.story_file if self.story_file is not None else self.directory / "stories.json"

    @property
    def scores(self) -> Path:
        return self.directory / "scores.csv"

    @property
    def state(self) -> Path:
        return self.directory / "variant.json"


def _plain(value: Any) -> Any:
    """JSON-comparable (what variant.json reads back)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def plan_variants(config: AblationConfig) -> list[Variant]:
    """The variants in config order."""
    out = Path(config.output_dir) / "variants"
    source = getattr(config, "source", None) or "ablation config"
    for name, path in config.stories.items():
        if not Path(path).is_file():  # checked here, not on loading: a shipped config names files to come
            raise ValueError(f"{source}: stories.{name}: no such story file {path}")
    if config.stories:
        return [Variant(name, out / name, {"story_file_sha256": _sha256(Path(path))}, story_file=Path(path))
                for name, path in config.stories.items()]
    base = _base_train(config)
    variants = []
    for name, overrides in config.variants.items():
        options = _plain({**base, **overrides})
        options.pop("output_dir", None)  # each variant trains in its own directory
        variants.append(Variant(name, out / name, {"train": options}, train_options=options))
    return variants


def _difference(old: Any, new: Any, where: str = "") -> str | None:
    """The first place where two JSON values differ, as ``where: old -> new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            found = _difference(old.get(key), new.get(key), f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return next((d for k, (a, b) in enumerate(zip(old, new)) if (d := _difference(a, b, f"{where}[{k}]"))), None)
    return None if old == new else f"{where or 'value'}: {json.dumps(old)} -> {json.dumps(new)}"


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}; delete it to redo what it records") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a file storyrl ablate wrote; delete it to redo what it records")
    return data


def _write_json(path: Path, data: dict) -> None:
    from storyrl.output_files import replace_file

    replace_file(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n", overwrite=True)


def _check_variant(variant: Variant, overwrite: bool) -> dict:
    """The variant's recorded state, after checking it was made as the config
    says now (else an error, or with ``overwrite`` a fresh directory)."""
    state = _read_json(variant.state)
    if state is not None:
        change = _difference(state.get("definition"), variant.definition)
        if change is None:
            return state
        if not overwrite:
            what = (f"its story file {variant.story_file} has other content" if variant.story_file is not None
                    else change)
            raise ValueError(f"variant {variant.name} changed since it ran ({variant.state}): {what}; use "
                             "--overwrite to redo it, or another output_dir")
        shutil.rmtree(variant.directory)
    elif variant.directory.is_dir() and any(variant.directory.iterdir()):
        if not overwrite:
            raise ValueError(f"variant {variant.name}: {variant.directory} holds files but no variant.json; use "
                             "--overwrite to redo it, or another output_dir")
        shutil.rmtree(variant.directory)
    state = {"definition": variant.definition, "trained": False}
    _write_json(variant.state, state)
    return state


# -- training and generation ----------------------------------------------------


@dataclass
class PolicyGeneratorConfig(GeneratorConfig):
    """Options of a trained policy's generation (recorded in the sidecar)."""

    policy: str = option("", "Directory of an RL-trained policy (OUTPUT_DIR/final of storyrl train rl).")
    generation_batch_size: int = option(8, "Sequences per generation batch.", min=1)

    # batch_size: sequences per generate_stories call, i.e. per policy load and story-file save
    runtime_options: ClassVar[tuple[str, ...]] = ("batch_size", "generation_batch_size")


class PolicyGenerator(Generator):
    """Greedy stories of an RL-trained policy
    (:func:`storyrl.training.rl.policy.generate_stories`) as a generator, so
    that :func:`storyrl.generators.runs.generate_to_file` writes, resumes and
    checks its story file and sidecar as ``storyrl generate``'s. Set
    ``rl_config`` (the policy's RLConfig) before generating."""

    name = "rl_policy"
    config_class = PolicyGeneratorConfig
    rl_config: Any = None

    def generate(self, records: Sequence[StoryRecord], progress: Any = None) -> Generations:
        from storyrl.training.rl.policy import generate_stories

        records = list(records)
        stories = generate_stories(self.rl_config, self.args.policy, records,
                                   batch_size=self.args.generation_batch_size)
        out = Generations()
        for record in records:
            story = stories.get(record.story_id)
            if isinstance(story, str):
                out.stories[record.story_id] = story
            else:
                out.failures[record.story_id] = "the policy generated no story"
        if progress is not None:
            progress(len(records))
        return out



def _train(variant: Variant, state: dict, progress: bool) -> Any:
    """Train the variant unless done; returns its RLConfig."""
    from storyrl.training.rl.train import train

    config = _rl_config(variant.train_options, variant.train_dir)
    if state.get("trained") and (variant.train_dir / "final").is_dir():
        return config
    resume = variant.train_dir.is_dir() and any(variant.train_dir.iterdir())
    if progress:
        print(f"ablate: training {variant.name}{' (resuming)' if resume else ''}", file=sys.stderr)
    train(config, resume=resume, progress=progress)
    if not (variant.train_dir / "final").is_dir():
        raise ValueError(f"variant {variant.name}: training left no policy in {variant.train_dir / 'final'}")
    _write_json(variant.state, {**state, "trained": True})
    return config


def _generated(variant: Variant, ids: Sequence[str]) -> bool:
    from storyrl.generators.runs import sidecar_path

    meta = _read_json(sidecar_path(variant.stories))
    if not meta or meta.get("complete") is not True or not variant.stories.is_file():
        return False
    stories = json.loads(variant.stories.read_text(encoding="utf-8"))
    return all(sid in stories or sid in meta.get("failures", {}) for sid in ids)


def _generate(variant: Variant, rl_config: Any, records: list[StoryRecord], config: AblationEval, progress: bool,
              inputs: dict) -> None:
    from storyrl.generators.runs import generate_to_file

    if _generated(variant, [r.story_id for r in records]):
        return
    if progress:
        print(f"ablate: generating {variant.name}", file=sys.stderr)
    generator = PolicyGenerator(policy=str(variant.train_dir / "final"), batch_size=config.save_every,
                                generation_batch_size=config.generation_batch_size)
    generator.rl_config = rl_config
    generate_to_file(generator, records, variant.stories, resume=True, progress=progress, inputs=inputs)
    del generator
    _release()


def _release() -> None:
    """Free the policy just used before the next variant trains."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- scoring and the table ----------------------------------------------------------


def _load_records(config: AblationEval) -> list[StoryRecord]:
    from storyrl.datasets import load_records

    records = load_records(config.data, config.data_format)
    records = records[: config.max_stories] if config.max_stories else records
    if not records:
        raise ValueError(f"{config.data}: no stories")
    return records


def _human(record: StoryRecord) -> StoryRecord:
    """The record's human story as the story to score: its reference, else its story."""
    if record.reference and record.reference.strip():
        return replace(record, story=record.reference, reference=None, noun_phrases=None)
    return replace(record, reference=None)


def _restrict(table: ScoreTable, ids: Sequence[str]) -> ScoreTable:
    present = set(table.ids)
    keep = [sid for sid in ids if sid in present]
    return ScoreTable(keep, {m: {sid: col[sid] for sid in keep if sid in col} for m, col in table.scores.items()})


def _means(table: ScoreTable, metrics: Sequence[str]) -> dict[str, float]:
    means = {}
    for m in metrics:
        values = [v for v in table.scores.get(m, {}).values() if math.isfinite(v)]
        means[m] = math.fsum(values) / len(values) if values else math.nan
    return means


def _check_metrics(out: Path, metrics: list, overwrite: bool) -> bool:
    """Whether every score file must be rescored: the metrics' options
    recorded in ``metrics.json`` differ from the config's (an error without
    ``overwrite``). A first run records them at once."""
    now = {"metrics": _plain({m.name: m.config() for m in metrics})}
    before = _read_json(out / "metrics.json")
    if before is None:
        _write_json(out / "metrics.json", now)
        return False
    change = _difference(before, now)
    if change is None:
        return False
    if not overwrite:
        raise ValueError(f"{out / 'metrics.json'}: the scores were made with other metrics ({change}); use "
                         "--overwrite to rescore every story, or another output_dir")
    return True


def _score(metrics: list, records: list[StoryRecord], path: Path, rescore: bool, config: AblationEval,
           progress: bool, label: str) -> ScoreTable:
    from storyrl.data import read_scores
    from storyrl.eval.scoring import score_to_file

    if progress:
        print(f"ablate: scoring {label}", file=sys.stderr)
    score_to_file(metrics, records, path, resume=not rescore, overwrite=rescore, batch_size=config.batch_size,
                  progress=progress)
    return read_scores(path)


def run_ablation(config: AblationConfig, progress: bool = True, only: Sequence[str] | None = None,
                 overwrite: bool = False) -> AblationResult:
    """Run the ablation (module docs): the ``only`` variants (default all);
    the table also holds the other variants that finished earlier."""
    from storyrl.data import read_scores
    from storyrl.eval.dhm import DHM_DIMENSIONS, dhm

    source = getattr(config, "source", None) or "ablation config"
    variants = plan_variants(config)
    names = [v.name for v in variants]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise ValueError(f"{source}: no variant {unknown[0]!r}; the variants are {', '.join(names)}")
    chosen = set(only or names)
    ev = config.eval
    records = _load_records(ev)
    ids = [r.story_id for r in records]
    try:
        metrics = [_metric(spec, ev.image_root) for spec in ev.metrics]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: eval.metrics: {exc}") from None
    metric_names = [m.name for m in metrics]
    dims = ev.dims()
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rescore = _check_metrics(out, metrics, overwrite)

    # Every chosen variant is checked before any work, so a changed one fails the run at once.
    states = {v.name: _check_variant(v, overwrite) for v in variants if v.name in chosen}
    inputs = {"data": str(ev.data), "max_stories": ev.max_stories, "ablation": source}
    for variant in variants:
        if variant.name in chosen and variant.story_file is None:
            rl_config = _train(variant, states[variant.name], progress)
            _generate(variant, rl_config, records, ev, progress, {**inputs, "variant": variant.name})
    done = [v for v in variants if v.name in chosen or _finished_earlier(v, ids, progress)]

    human_records = [_human(r) for r in records]
    if ev.human_scores is not None:
        human = read_scores(ev.human_scores)
        missing = [m for m in dims if m not in human.scores]
        if missing:
            raise ValueError(f"{ev.human_scores}: no {', '.join(missing)} column (it has {human.metrics})")
    else:
        if not any(r.story.strip() for r in human_records):
            raise ValueError(f"{ev.data}: the records have no human stories; give eval.human_scores")
        human = _score(metrics, human_records, out / "human_scores.csv", rescore, ev, progress, "the human stories")
    human = _restrict(human, ids)

    rows = []
    for variant in done:
        stories = _stories(variant)
        generated = [StoryRecord(r.story_id, stories[r.story_id], images=r.images, image_ids=r.image_ids,
                                 reference=h.story) for r, h in zip(records, human_records) if r.story_id in stories]
        table = _restrict(_score(metrics, generated, variant.scores, rescore, ev, progress, variant.name), ids)
        result = dhm(human, table, dims)
        rows.append(VariantResult(variant.name, len(records), len(generated), len(records) - len(generated),
                                  len(generated) - result.n, result.n, _means(table, metric_names),
                                  result.distances, result.d_hm))
    if rescore:  # every score file now holds the new metrics' scores
        _write_json(out / "metrics.json", {"metrics": _plain({m.name: m.config() for m in metrics})})
    human_row = VariantResult(HUMAN, len(records), len(human.ids), len(records) - len(human.ids), 0, len(human.ids),
                              _means(human, metric_names))
    result = AblationResult(rows, human_row, metric_names, [DHM_DIMENSIONS[d][0] for d in dims])
    write_ablation_report(result, out)
    return result


def _finished_earlier(variant: Variant, ids: Sequence[str], progress: bool) -> bool:
    """A variant not chosen this run joins the table when it finished earlier,
    as the config says now."""
    state = _read_json(variant.state)
    if state is None or _difference(state.get("definition"), variant.definition) is not None:
        if progress and state is not None:
            print(f"ablate: {variant.name} changed since it ran; left out of the table", file=sys.stderr)
        return False
    return variant.story_file is not None or _generated(variant, ids)


def _stories(variant: Variant) -> dict[str, str]:
    from storyrl.data import load_stories

    return {r.story_id: r.story for r in load_stories(variant.stories)}
