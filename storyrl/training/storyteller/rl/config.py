"""The RL run's options: :class:`RLConfig` (``storyrl train rl --config configs/rl/<name>.yaml``).

One YAML file sets the policy, the data and its prompts, the rewards, and
the algorithm's own options as a nested mapping: ``ppo`` (storyrl's
:class:`~storyrl.training.storyteller.rl.ppo.config.PPOConfig`), ``grpo`` / ``rloo``
(TRL's ``GRPOConfig`` / ``RLOOConfig``, any of their keys).

Which keys win: ``output_dir``, ``seed``, ``max_steps``, ``report_to``,
``reward_weights`` and ``merge_adapters_for_sampling`` belong to the run, not
to one algorithm. They are set at the top level only and flow into the
algorithm's config (the last one into PPO's; for GRPO/RLOO storyrl's trainer
class reads it); writing one of them
inside ``ppo``/``grpo``/``rloo`` is an error (so no file says two things).
Everything else -- learning rate, batch sizes, KL coefficient (``beta`` /
``kl_coef``), generation length, ``multi_objective_aggregation``, saving and
logging steps -- is the algorithm's key with the algorithm's default. Without
CUDA the TRL configs default to ``use_cpu: true, bf16: false`` (TRL's own
default, bf16, needs a GPU); on a GPU ``bf16`` defaults to what it supports.

The resolved config is saved as ``<output_dir>/rl_config.yaml`` by
:meth:`RLConfig.to_yaml`: the nested TRL configs keep only the keys that were
given (``GRPOConfig.to_dict`` lists every derived value and does not load
back), so the file reads back with :meth:`RLConfig.from_yaml`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from storyrl.config import Config, ConfigError, ConfigTypeError, _bound_problem, check_type, first_nonfinite, option
from storyrl.training.storyteller.rl.ppo.config import PPOConfig, tracker_problems
from storyrl.training.storyteller.config import POLICIES, SETTINGS, LoraOptions, StorytellerConfig

__all__ = ["ALGORITHMS", "FLOWED_KEYS", "POLICIES", "SETTINGS", "Algorithm", "LoraOptions", "RLConfig",
           "reward_problems"]

#: Run-level keys set at the top level and copied into the algorithm's config.
FLOWED_KEYS = ("output_dir", "seed", "max_steps", "report_to", "reward_weights", "merge_adapters_for_sampling")
# Attribute on a built nested config holding the keys the user gave (what is saved).
_GIVEN = "_storyrl_given"


def _storyrl_flowed(run: RLConfig) -> dict[str, Any]:
    """The run-level keys as storyrl's own configs take them (PPOConfig)."""
    return {"output_dir": run.output_dir, "seed": run.seed, "max_steps": run.max_steps, "report_to": run.report_to,
            "merge_adapters_for_sampling": run.merge_adapters_for_sampling}


def _trl_flowed(run: RLConfig) -> dict[str, Any]:
    """The run-level keys as TRL's configs take them: max_steps -1 is TRL's
    'not set'; the reward weights are TRL's too. (merge_adapters_for_sampling
    is storyrl's: the trainer class reads it, TRL's config has no such key.)"""
    return {"output_dir": run.output_dir, "seed": run.seed, "max_steps": -1 if run.max_steps is None else run.max_steps,
            "report_to": run.report_to, "reward_weights": run.reward_weights}


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm: ``config_class`` is its nested config (the RLConfig
    key of the algorithm's name), ``run`` the ``module:function`` that trains
    with it, imported when a run starts (``run(config, policy, dataset,
    rewards, resume=, progress=, callbacks=)`` returns an
    :class:`~storyrl.training.storyteller.rl.train.RLResult`), ``flowed`` the run-level
    keys (:data:`FLOWED_KEYS`) as its config takes them, ``callbacks``
    whether its trainer calls transformers ``TrainerCallback`` objects.
    ``config_class`` may be a ``"module:Class"`` string, imported by
    :meth:`config_type` when a config of the algorithm is built (TRL's
    import takes seconds; ``--help`` and config errors need none of it)."""

    config_class: type | str
    run: str
    flowed: Callable[[RLConfig], dict[str, Any]]
    callbacks: bool = True

    def config_type(self) -> type:
        if isinstance(self.config_class, type):
            return self.config_class
        import importlib

        module, _, name = self.config_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def runner(self) -> Callable[..., Any]:
        import importlib

        module, _, function = self.run.partition(":")
        return getattr(importlib.import_module(module), function)


#: Every RL algorithm: what the ``algorithm`` key accepts, the nested
#: configs, and what a run calls. A new one is a line here and an RLConfig
#: field of the same name holding its config.
ALGORITHMS: dict[str, Algorithm] = {
    "ppo": Algorithm(PPOConfig, "storyrl.training.storyteller.rl.train:run_ppo", _storyrl_flowed, callbacks=False),
    "grpo": Algorithm("trl:GRPOConfig", "storyrl.training.storyteller.rl.train:run_trl", _trl_flowed),
    "rloo": Algorithm("trl:RLOOConfig", "storyrl.training.storyteller.rl.train:run_trl", _trl_flowed),
}


@dataclass(kw_only=True)
class RLConfig(StorytellerConfig):
    """Settings of :func:`storyrl.training.storyteller.rl.train.train` (module docs); the
    policy, data and prompt keys are :class:`StorytellerConfig`'s."""

    _field_word = "key"

    # -- algorithm and run ----------------------------------------------------------
    algorithm: str = option("grpo", "ppo (storyrl's, on accelerate), grpo or rloo (TRL's trainers).",
                            choices=tuple(ALGORITHMS))
    output_dir: str = option(help="Checkpoints, rl_config.yaml, history.jsonl, samples.jsonl and final/.",
                             path="new-dir")
    seed: int = option(0, "Seed of the run (data order, sampling, adapter initialisation).")
    max_steps: int | None = option(None, "Optimisation steps to run (GRPO/RLOO: optimizer steps; PPO: rollout + "
                                   "update steps); default: the algorithm's epochs over the data.", min=1)
    report_to: str | list[str] = option("none", "Trackers: tensorboard, wandb, ... (a name or a list), all or none.")
    merge_adapters_for_sampling: bool = option(True, "Sample the rollouts (PPO, and GRPO/RLOO without use_vllm) "
                                               "with the LoRA adapters merged into a copy of the weights they "
                                               "adapt, restored bit for bit afterwards: as fast as generate on "
                                               "merged weights, one extra copy of those weights while sampling "
                                               "(not with load_in_4bit: sampled unmerged); false: through peft's "
                                               "unmerged adapters.")
    # -- rewards ------------------------------------------------------------------
    rewards: list[str | dict[str, Any]] = option(help="Rewards (TRL reward functions): registered names, reward "
                                                 "config YAML paths or mappings {reward: <name>, <option>: ...}.")
    reward_weights: list[float] | None = option(None, "One weight per reward (default: all 1).")
    async_rewards: bool = option(False, "Run each reward in a worker thread of its own, concurrently with the "
                                 "others (TRL's async reward functions; PPO likewise): helps with several model or "
                                 "remote rewards. The remote reward is concurrent anyway.")
    prepare_rewards: bool = option(True, "Before training, embed the image side of every dataset row (regions or "
                                   "images, into each reward's caches: its disk cache with cache_dir) and score "
                                   "d_HM's human stories once, so that a step only does the generated stories' "
                                   "text work (Reward.prepare); false: done inside the steps on first visits.")
    # -- the algorithms' own options -------------------------------------------------
    ppo: PPOConfig | None = option(None, "storyrl PPOConfig keys (algorithm ppo).", cli=False)
    # GRPOConfig / RLOOConfig | None once built; typed Any so that reading
    # the options (--help, option_info) does not import TRL.
    grpo: Any = option(None, "TRL GRPOConfig keys (algorithm grpo).", cli=False)
    rloo: Any = option(None, "TRL RLOOConfig keys (algorithm rloo).", cli=False)

    def __post_init__(self) -> None:
        # The nested configs are built here, not by the generic nested path,
        # so that the run-level keys flow into them and the given keys are
        # remembered (what rl_config.yaml keeps).
        label = self._label()
        for name in (*FLOWED_KEYS, "algorithm"):
            info = next(i for i in _infos(type(self)) if i.name == name)
            try:
                setattr(self, name, check_type(getattr(self, name), info.type))
            except TypeError as exc:
                raise TypeError(f"{label}: key {name!r}: {exc}") from None
        self._check_run_types()
        self._check_run_problems()
        for name, algorithm in ALGORITHMS.items():
            value = getattr(self, name)
            if value is None and name != self.algorithm:
                continue
            if name != self.algorithm and self.algorithm in ALGORITHMS:  # it would be ignored without a word
                raise ValueError(f"{label}: {name}: options for algorithm {name}, but the run's algorithm is "
                                 f"{self.algorithm}; remove the {name} section or set algorithm: {name}")
            setattr(self, name, self._nested(name, algorithm, value))
        super().__post_init__()

    def _check_run_types(self) -> None:
        """The types of the other top-level keys, as Config.__post_init__
        checks them, but before the algorithm's config is built: a wrong
        type is reported without importing TRL (seconds)."""
        label, word = self._label(), self._field_word
        for info in _infos(type(self)):
            if info.name in ALGORITHMS:
                continue
            try:
                value = check_type(getattr(self, info.name), info.type)
            except TypeError as exc:
                raise ConfigTypeError(f"{word} {info.name!r}: {exc}", owner=label, option=info.name) from None
            except ValueError as exc:  # a nested config's value
                raise ConfigError(f"{word} {info.name!r}: {exc}", owner=label, option=info.name) from None
            object.__setattr__(self, info.name, value)

    def _check_run_problems(self) -> None:
        """The top-level keys' bounds and the policy, data and prompt problems,
        before the algorithm's config is built (a missing data file is
        reported without importing TRL); :meth:`_problems` adds the rest."""
        problems = [p for info in _infos(type(self))
                    if info.name not in ALGORITHMS and (p := _bound_problem(info, getattr(self, info.name)))]
        problems += StorytellerConfig._problems(self) + self._run_problems()
        if problems:
            raise ConfigError("; ".join(problems), owner=self._label())

    def _nested(self, name: str, algorithm: Algorithm, value: Any) -> Any:
        label = self._label()
        cls, flowed = algorithm.config_type(), algorithm.flowed(self)
        if value is None:
            given = {}
        elif isinstance(value, Mapping):
            given = dict(value)
        elif isinstance(value, cls):
            given = getattr(value, _GIVEN, None)
            if given is None:
                given = _changed_keys(value, flowed)
        else:
            raise TypeError(f"{label}: key {name!r}: expected a mapping of {cls.__name__} keys, "
                            f"got {type(value).__name__}")
        owned = [k for k in FLOWED_KEYS if k in given]
        if owned:
            raise ValueError(f"{label}: {name}: set {', '.join(owned)} at the top level (it applies to the whole "
                             f"run), not inside {name}")
        if not issubclass(cls, Config):
            _check_trl_types(cls, given, f"{label}: {name}")
        try:
            built = cls.from_mapping({**given, **flowed}) if issubclass(cls, Config) else \
                cls(**{**self._device_defaults(given), **given, **flowed})
        except TypeError as exc:
            raise ValueError(f"{label}: {name}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{label}: {name}: {' '.join(str(exc).split())}") from None
        object.__setattr__(built, _GIVEN, given)
        return built

    @staticmethod
    def _device_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
        """TRL's mixed-precision default (bf16) needs a GPU: without CUDA the
        TRL configs run on the CPU in fp32 unless the file says otherwise."""
        import torch

        if not torch.cuda.is_available():
            return {"use_cpu": True, "bf16": False}
        if "fp16" in given:
            return {}
        from storyrl.models.runtime import cuda_native_bf16

        return {"bf16": cuda_native_bf16()}

    def _run_problems(self) -> list[str]:
        """The rewards' and trackers' problems (no algorithm config needed)."""
        problems = []
        if not self.rewards:
            problems.append("rewards: give at least one reward")
        problems += reward_problems(self.rewards, "TRL logs rewards by name")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            problems.append(f"reward_weights: {len(self.reward_weights)} weights for {len(self.rewards)} rewards")
        if self.reward_weights is not None and not all(math.isfinite(w) for w in self.reward_weights):
            problems.append(f"reward_weights: every weight must be a finite number, got {self.reward_weights}")
        elif self.reward_weights is not None and not any(self.reward_weights):
            problems.append("reward_weights: every weight is 0; nothing would be optimised")
        return problems + tracker_problems(self.report_to)

    def _problems(self) -> list[str]:
        # What needs the built algorithm configs or the policy's kind; the
        # other problems were refused by _check_run_problems before the build.
        from storyrl.training.storyteller.rl.vllm_options import vllm_problems

        problems = self._precision_problems()
        for name in ("grpo", "rloo"):
            section = getattr(self, name)
            if section is not None:
                problems += vllm_problems(name, getattr(section, _GIVEN, None) or {}, section, self.load_in_4bit)
        kind = self.policy_kind(read_hub=False)
        if kind == "tapm":
            if self.algorithm != "ppo":
                problems.append(f"algorithm {self.algorithm}: a TAPM policy trains with ppo only (TRL's trainers "
                                "drive a model by input_ids alone; TAPM needs its visual features)")
            if self.lora.enabled or self.load_in_4bit:
                problems.append("lora/load_in_4bit: a TAPM policy keeps the adapters and quantisation it was "
                                "trained with (storyrl train tapm); leave them off here")
        return problems

    def _precision_problems(self) -> list[str]:
        """Precisions that cannot train here, refused now rather than coerced
        or failing at the first step: fp16 weights that would themselves be
        trained (no fp32 master copy, no loss scaling: small updates vanish
        and the GradScaler of fp16 mixed precision refuses fp16 gradients;
        frozen fp16 under LoRA is fine, peft keeps the adapters in fp32),
        and bf16 weights or autocast on a CUDA GPU without bf16."""
        problems = []
        if self.precision == "fp16" and not (self.lora.enabled or self.load_in_4bit):
            problems.append("precision: fp16 would train the policy's own weights in fp16 (no fp32 copy, no loss "
                            "scaling); use lora (fp16 base, fp32 adapters), bf16, or fp32 with mixed precision")
        fp16 = [f"{name}.fp16" for name in ("grpo", "rloo") if getattr(getattr(self, name), "fp16", False) is True]
        if fp16:
            import torch

            if not torch.cuda.is_available():  # measured: the CPU step's log-probs equal fp32's exactly
                problems.append(f"{', '.join(fp16)}: TRL's Trainer makes fp16 autocast and its GradScaler on CUDA "
                                "only, and on the CPU would train in fp32; use bf16: true or leave fp16 off")
        # (ppo.mixed_precision: bf16 is PPOConfig's own check)
        keys = [k for k, on in (("precision", self.precision == "bf16"),
                                ("grpo.bf16", getattr(self.grpo, "bf16", False) is True),
                                ("rloo.bf16", getattr(self.rloo, "bf16", False) is True)) if on]
        if keys:
            import torch

            from storyrl.models.runtime import cuda_native_bf16

            if torch.cuda.is_available() and not cuda_native_bf16():
                problems.append(f"{', '.join(keys)}: bf16 needs a GPU with bf16 support and this CUDA device has "
                                "none; use fp16 (mixed precision) or fp32")
        return problems

    # -- derived ----------------------------------------------------------------------
    def algorithm_config(self) -> Any:
        """The config of the chosen algorithm (PPOConfig, GRPOConfig or RLOOConfig)."""
        return getattr(self, self.algorithm)

    def build_rewards(self) -> list[Any]:
        """The storyrl rewards of ``rewards``, in order (no model loaded yet)."""
        return [_reward(entry) for entry in self.rewards]

    def reward_functions(self, rewards: list[Any]) -> list[Any]:
        """The rewards as the trainers call them: with ``async_rewards``,
        each sync one wrapped in :class:`~storyrl.rewards.concurrent.AsyncReward`."""
        if not self.async_rewards:
            return list(rewards)
        from storyrl.rewards.concurrent import AsyncReward, is_async_reward

        return [r if is_async_reward(r) else AsyncReward(r) for r in rewards]

    # -- saving -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for info in _infos(type(self)):
            value = getattr(self, info.name)
            if info.name in ALGORITHMS:
                out[info.name] = None if value is None else _yaml_safe(getattr(value, _GIVEN, None) or {})
            elif isinstance(value, Config):
                out[info.name] = value.to_dict()
            else:
                out[info.name] = _yaml_safe(value)
        return out


def _documented_types(cls: type, name: str) -> set[str]:
    """The type names a TRL/transformers config's docstring gives for ``name``
    (``scale_rewards (`str` or `bool`, ...)``): values the framework takes
    although its annotation is narrower."""
    import re

    for klass in cls.__mro__:
        match = re.search(rf"^\s*{re.escape(name)} \(([^)]*)\)", klass.__doc__ or "", re.M)
        if match:
            return set(re.findall(r"`([A-Za-z_]+)`", match.group(1)))
    return set()


def _check_trl_types(cls: type, given: Mapping[str, Any], label: str) -> None:
    """Each given key of a TRL config has its field's type, as storyrl's own
    options do (TrainingArguments would turn "1e-3" into a float): checked,
    never converted; NaN and infinity are refused for numbers (infinity
    where the field's default is not infinite)."""
    import typing

    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key, value in given.items():
        if key not in known:
            raise ValueError(f"{label}: unknown key {key!r} (see TRL's {cls.__name__})")
        default = next(f.default for f in dataclasses.fields(cls) if f.name == key)
        bad = first_nonfinite(value, allow_inf=isinstance(default, float) and math.isinf(default))
        if bad is not None:  # TRL would train with it (learning_rate: .inf makes every weight NaN)
            raise ValueError(f"{label}: key {key!r}: expected a {'' if math.isnan(bad) else 'finite '}number, "
                             f"got {bad!r}")
        try:
            check_type(value, hints[key])
        except TypeError as exc:
            if type(value).__name__ not in _documented_types(cls, key):
                raise ValueError(f"{label}: key {key!r}: {exc}") from None


def _infos(cls: type):
    from storyrl.config import option_info

    return option_info(cls)


def reward_problems(entries: list, why_unique: str) -> list[str]:
    """One message per reward entry that cannot be built, and per name two
    entries share (``why_unique``: why names must differ)."""
    problems, names = [], []
    for i, entry in enumerate(entries):
        try:
            names.append(_reward(entry).__name__)
        except (TypeError, ValueError) as exc:
            problems.append(f"rewards[{i}]: {' '.join(str(exc).split())}")
    problems += [f"rewards: two rewards named {n!r} ({why_unique}); give one a different setting"
                 for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def _reward(entry: str | Mapping[str, Any]) -> Any:
    """A reward from a registered name, a reward config file or an inline
    ``{reward: name, ...}`` mapping (the composite rewards' component specs)."""
    from storyrl.rewards import build_reward

    return build_reward(entry)


def _changed_keys(value: Any, flowed: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a TRL config built in Python that differ from a default
    one (its given keys are not recorded): the derived generation batch
    settings are kept only where they cannot be derived again."""
    if isinstance(value, Config):
        default = type(value)()
        return {k: v for k, v in value.to_dict().items() if k not in FLOWED_KEYS and v != getattr(default, k)}
    base = {**RLConfig._device_defaults({}), **flowed}
    default = type(value)(**base)
    out = {}
    for f in dataclasses.fields(value):
        if not f.init or f.name in FLOWED_KEYS:
            continue
        mine, theirs = getattr(value, f.name), getattr(default, f.name)
        if mine != theirs:
            out[f.name] = mine.value if isinstance(mine, enum.Enum) else mine
    if "generation_batch_size" in out or "steps_per_generation" in out:
        # TRL derives one from the other and refuses both.
        out.pop("steps_per_generation", None)
        out["generation_batch_size"] = value.generation_batch_size
    return out


def _yaml_safe(value: Any) -> Any:
    """YAML-safe plain values (enums by value, tuples as lists)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: _yaml_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return json.loads(json.dumps(value, default=str))
