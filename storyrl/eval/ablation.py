"""Reward ablations: the same RL training with each reward variant, every
resulting policy evaluated on the same held-out sequences with the full
metric suite and d_HM against the human stories (issue 11 part 4).

:func:`run_ablation` runs an :class:`AblationConfig` (``storyrl ablate
--config configs/ablations/<name>.yaml``). Per variant, under
``OUTPUT_DIR/variants/<name>/``:

1. **Training** (``train/``): the base RL config (``train``) with the
   variant's reward options (``rewards``, ``reward_weights``, ...) through
   :func:`storyrl.training.storyteller.rl.train.train`; the policy lands in
   ``train/final/``.
2. **Generation**: greedy stories of the trained policy for the held-out
   sequences (``eval.data``) through
   :func:`storyrl.training.storyteller.rl.policy.generate_stories`, written as
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

One process: the variants train one after another, each with what
:func:`~storyrl.training.storyteller.rl.train.train` does on one device. To train on
several GPUs, run ``accelerate launch -m storyrl train rl`` per variant and
evaluate the resulting story files with ``stories``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from storyrl.config import option
from storyrl.data import ScoreTable, StoryRecord
from storyrl.datasets import load_some_records
from storyrl.eval.ablation_config import HUMAN, AblationConfig, AblationEval, _base_train, _metric, _rl_config
from storyrl.eval.ablation_report import AblationResult, VariantResult, write_ablation_report
from storyrl.generators.base import Generations, Generator, GeneratorConfig
from storyrl.training.runs import lock_directory

__all__ = ["AblationConfig", "AblationEval", "AblationResult", "PolicyGenerator", "Variant", "VariantResult",
           "plan_variants", "run_ablation"]

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


def _json_comparable(value: Any) -> Any:
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
        options = _json_comparable({**base, **overrides})
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
    (:func:`storyrl.training.storyteller.rl.policy.generate_stories`) as a generator, so
    that :func:`storyrl.generators.runs.generate_to_file` writes, resumes and
    checks its story file and sidecar as ``storyrl generate``'s. Set
    ``rl_config`` (the policy's RLConfig) before generating."""

    name = "rl_policy"
    config_class = PolicyGeneratorConfig
    rl_config: Any = None

    def generate(self, records: Sequence[StoryRecord], progress: Any = None) -> Generations:
        from storyrl.training.storyteller.rl.policy import generate_stories

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
    from storyrl.training.storyteller.rl.train import train

    config = _rl_config(variant.train_options, variant.train_dir)
    if state.get("trained") and (variant.train_dir / "final").is_dir():
        if progress:
            print(f"ablate: {variant.name} was trained earlier", file=sys.stderr)
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
    from storyrl.models.runtime import free_memory

    if _generated(variant, [r.story_id for r in records]):
        return
    if progress:
        print(f"ablate: generating {variant.name}", file=sys.stderr)
    generator = PolicyGenerator(policy=str(variant.train_dir / "final"), batch_size=config.save_every,
                                generation_batch_size=config.generation_batch_size)
    generator.rl_config = rl_config
    generate_to_file(generator, records, variant.stories, resume=True, progress=progress, inputs=inputs)
    del generator
    free_memory()  # the policy just used, before the next variant trains (the reward models stay)


# -- scoring and the table ----------------------------------------------------------


def _human(record: StoryRecord) -> StoryRecord:
    """The record's human story as the story to score: its reference, else its story."""
    if record.reference and record.reference.strip():
        return replace(record, story=record.reference, reference=None, noun_phrases=None)
    return replace(record, reference=None)


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
    now = {"metrics": _json_comparable({m.name: m.config() for m in metrics})}
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
    with _unscorable_counted(metrics, label):
        score_to_file(metrics, records, path, resume=not rescore, overwrite=rescore, batch_size=config.batch_size,
                      progress=progress)
    return read_scores(path)


class _DropUnscorable(logging.Filter):
    """The rewards' per-story ``unscorable story`` warnings: counted instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("%s: unscorable story")


@contextlib.contextmanager
def _unscorable_counted(metrics: list, label: str):
    """Score without the per-story warnings, then print one line per metric
    and reason: ``ablate: <label>: bleu: 4 unscorable: no reference``."""
    reasons = [getattr(m, "stats", {}).get("reasons", Counter()) for m in metrics]
    before = [Counter(r) for r in reasons]
    quiet, logger = _DropUnscorable(), logging.getLogger("storyrl.rewards.base")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        for metric, now, earlier in zip(metrics, reasons, before):
            for reason, count in (Counter(now) - earlier).most_common():
                print(f"ablate: {label}: {metric.name}: {count} unscorable: {reason}", file=sys.stderr)


def run_ablation(config: AblationConfig, progress: bool = True, only: Sequence[str] | None = None,
                 overwrite: bool = False) -> AblationResult:
    """Run the ablation (module docs): the ``only`` variants (default all);
    the table also holds the other variants that finished earlier. The
    output directory is locked for the whole run."""
    source = getattr(config, "source", None) or "ablation config"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # every process would train, generate and score each variant into the same files
        raise ValueError("storyrl ablate runs as one process; to train on several GPUs run `accelerate launch -m "
                         "storyrl train rl` per variant and evaluate the stories with an ablation over story files")
    variants = plan_variants(config)
    names = [v.name for v in variants]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise ValueError(f"{source}: no variant {unknown[0]!r}; the variants are {', '.join(names)}")
    chosen = set(only or names)
    ev = config.eval
    records = load_some_records(ev.data, ev.data_format, ev.max_stories)
    try:
        metrics = [_metric(spec, ev.image_root) for spec in ev.metrics]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: eval.metrics: {exc}") from None
    out = Path(config.output_dir)
    with lock_directory(out):  # one ablation per directory: a second one fails at once
        return _run_locked(config, variants, chosen, records, metrics, progress, overwrite)


def _run_locked(config: AblationConfig, variants: list[Variant], chosen: set[str], records: list[StoryRecord],
                metrics: list, progress: bool, overwrite: bool) -> AblationResult:
    from storyrl.data import read_scores
    from storyrl.eval.dhm import DHM_DIMENSIONS, dhm

    source = getattr(config, "source", None) or "ablation config"
    ev = config.eval
    ids = [r.story_id for r in records]
    metric_names = [m.name for m in metrics]
    dims = ev.dims()
    out = Path(config.output_dir)
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
        human = read_scores(ev.human_scores, require=dims)
    else:
        if not any(r.story.strip() for r in human_records):
            raise ValueError(f"{ev.data}: the records have no human stories; give eval.human_scores")
        human = _score(metrics, human_records, out / "human_scores.csv", rescore, ev, progress, "the human stories")
    human = human.restricted(ids)

    rows = []
    for variant in done:
        stories = _stories(variant)
        generated = [StoryRecord(r.story_id, stories[r.story_id], images=r.images, image_ids=r.image_ids,
                                 reference=h.story) for r, h in zip(records, human_records) if r.story_id in stories]
        table = _score(metrics, generated, variant.scores, rescore, ev, progress, variant.name).restricted(ids)
        result = dhm(human, table, dims)
        rows.append(VariantResult(variant.name, len(records), len(generated), len(records) - len(generated),
                                  len(generated) - result.n, result.n, _means(table, metric_names),
                                  result.distances, result.d_hm))
    if rescore:  # every score file now holds the new metrics' scores
        _write_json(out / "metrics.json", {"metrics": _json_comparable({m.name: m.config() for m in metrics})})
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
