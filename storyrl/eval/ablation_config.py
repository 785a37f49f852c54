"""The options of a reward ablation (:mod:`storyrl.eval.ablation`):
:class:`AblationConfig` (``configs/ablations/*.yaml``) and its held-out
evaluation :class:`AblationEval`. Loading one checks everything that can be
checked without loading a model: every metric is built, every variant's RL
config (the base with the variant's reward options) is validated."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.config import Config, ConfigError, load_yaml, option
from storyrl.datasets import DATA_FORMATS

__all__ = ["HUMAN", "AblationConfig", "AblationEval"]

#: Label of the human stories' row in the table (no variant may take it).
HUMAN = "human"

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
    data_format: str = option("auto", "Format of data.", choices=DATA_FORMATS)
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
                raise ConfigError.of(exc).named("eval", AblationEval._label()) from None
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
    from storyrl.training.storyteller.rl.config import RLConfig

    return RLConfig.from_mapping({**options, "output_dir": str(train_dir)})
