"""storyrl rewards as verl custom reward functions.

verl loads a Python file (``custom_reward_function.path``), takes the function
named by ``custom_reward_function.name`` and adds the mapping
``custom_reward_function.reward_kwargs`` to every call. Where those keys live
and how the function is called depend on the verl version (checked against
verl's released code; the tests run verl's own loader and reward managers):

====================  =====================================  ==========================================
verl                  config keys                            how the function is called
====================  =====================================  ==========================================
0.9.x                 ``reward.custom_reward_function.*``    reward loop: once per sample, sync or async
                      (the top-level keys are ignored)       (``reward.reward_manager.name``: naive, gdpo,
                                                             dapo...; there is no ``batch`` manager)
0.7.1 -- 0.8.x        ``custom_reward_function.*`` (moved    reward loop, as above; ``reward_model.
                      under ``reward.``) or ``reward.…``     reward_manager=batch`` fails ("Unknown reward
                                                             manager: batch"); GDPO from 0.8.0
up to 0.7.0           ``custom_reward_function.*``           legacy managers: ``naive`` once per sample,
                                                             ``batch`` once per batch
====================  =====================================  ==========================================

Which function to name:

* ``compute_score_async`` (verl >= 0.7.1, the recommended one): verl's reward
  loop calls it for every sample of a worker's chunk at once; the calls are
  gathered (up to ``storyrl_batch_size`` stories, waiting at most
  ``storyrl_wait_ms``) into one reward call, so a model reward makes one
  forward per batch, not per story.
* ``compute_score``: the same, synchronous, one story per reward call.
* ``compute_score_batch`` with ``reward_model.reward_manager=batch`` (verl
  <= 0.7.0 only): lists in, one result per story out.

``reward_kwargs``: ``storyrl_config`` (the reward config YAML; default: the
``STORYRL_REWARD_CONFIG`` environment variable, which Ray workers must see),
``storyrl_fallback`` (the value of an unscorable story, default 0.0),
``storyrl_details`` (dict results, below), ``storyrl_gdpo`` (below),
``storyrl_batch_size`` and ``storyrl_wait_ms`` (the async gathering). A model
reward served by ``storyrl serve`` on a GPU is used through a ``reward:
remote`` config.

What storyrl reads from a sample: ``solution_str`` is the story;
``ground_truth`` (``reward_model.ground_truth`` in verl's data) is the human
story (``reference``, for d_HM) or a mapping with any of
:data:`storyrl.integrations.CONTEXT_KEYS`; ``extra_info`` may carry
``story_id``, ``images`` / ``story_images`` (image paths, one per position),
``image_ids``, ``noun_phrases`` and ``reference`` (keys verl adds, such as
``num_turns``, are ignored). ``data_source`` is not used.

Results: a float; or, when the reward logs per-sample components (the
composite ``dhm`` / ``weighted`` rewards) or ``storyrl_details=True``, a dict
``{"score": total, <component>: value, ..., "unscorable": 0.0 | 1.0}``:
verl takes ``"score"`` as the reward and stacks the other keys per sample as
``reward_extra_info`` (logged; usable as GDPO's ``gdpo_reward_keys``). verl
takes no None or NaN: an unscorable story gets the fallback, is counted in
:data:`storyrl.integrations.STATS` and flagged by ``unscorable``. A reward
has the same keys on every call (verl stacks them per key).

Batch- and group-normalised rewards (a ``weighted`` component with
``normalize: batch`` or ``group``) depend on which stories are scored
together, and the reward loop scores one sample at a time, so they are
refused -- except through GDPO (verl >= 0.8.0), which is group
normalisation done by verl itself: ``storyrl_gdpo: true`` makes the function
return each component's raw value as its own key, and
``algorithm.adv_estimator=gdpo`` with ``gdpo_reward_keys`` /
``gdpo_reward_weights`` (see :func:`gdpo_settings` and :func:`overrides`)
z-scores each key within its prompt's group, weights them and whitens the
sum. ``"score"`` is then the weighted sum of the raw values (logged only).
GDPO z-scores with the unbiased std plus 1e-6 where storyrl uses the
population std, and whitens the sum over the batch: the advantages are
storyrl's up to that scale. ``normalize: batch`` has no per-sample form: use
``group`` or ``range``, or verl <= 0.7.0's batch manager.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import storyrl.integrations.scoring as _core
from storyrl.integrations.batching import RequestBatcher

__all__ = ["compute_score", "compute_score_async", "compute_score_batch", "gdpo_settings", "overrides"]

# Component keys of a reward's dict results, fixed by its first call so that
# every sample verl collects has the same keys.
_KEYS: dict[int, tuple[str, ...]] = {}
# verl's reward loop keeps one event loop per worker: one batcher per loop and reward.
_BATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RAW: dict[str, Any] = {}
_RAW_LOCK = threading.Lock()

_PER_SAMPLE = (
    "reward {name!r} normalises over the batch or prompt groups, and verl's reward loop scores one story at a "
    "time, so that normalisation would be lost. For group normalisation use GDPO (verl >= 0.8.0): "
    "reward_kwargs storyrl_gdpo: true with algorithm.adv_estimator=gdpo (storyrl.integrations.verl.overrides "
    "prints the settings); otherwise use normalize: range or none, or verl <= 0.7.0's batch reward manager "
    "with compute_score_batch"
)


def compute_score(
    data_source: Any = None,
    solution_str: Any = None,
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    storyrl_config: str | None = None,
    storyrl_fallback: float | None = None,
    storyrl_details: bool | None = None,
    storyrl_gdpo: bool = False,
    **kwargs: Any,
) -> float | dict[str, float]:
    """verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None, **kwargs)`` for one story (keyword arguments verl adds
    that storyrl does not use are ignored)."""
    reward = _reward(storyrl_config, storyrl_gdpo)
    fallback = _core.resolve_fallback(storyrl_fallback)
    context = _sample_context(ground_truth, extra_info, 0)
    scored = _core.score_stories(reward, [solution_str], _core.context_columns([context]))
    return _results(reward, scored, fallback, storyrl_details)[0]


async def compute_score_async(
    data_source: Any = None,
    solution_str: Any = None,
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    storyrl_config: str | None = None,
    storyrl_fallback: float | None = None,
    storyrl_details: bool | None = None,
    storyrl_gdpo: bool = False,
    storyrl_batch_size: int = 64,
    storyrl_wait_ms: float = 5.0,
    **kwargs: Any,
) -> float | dict[str, float]:
    """:func:`compute_score` as a coroutine for verl's reward loop: calls
    made concurrently in one event loop are scored together, in one reward
    call of up to ``storyrl_batch_size`` stories made in a worker thread
    (the first call waits at most ``storyrl_wait_ms`` for others)."""
    reward = _reward(storyrl_config, storyrl_gdpo)
    fallback = _core.resolve_fallback(storyrl_fallback)
    context = _sample_context(ground_truth, extra_info, 0)
    batcher = await _batcher(reward, storyrl_batch_size, storyrl_wait_ms)
    scored = await batcher.submit([solution_str], [context])
    return _results(reward, scored, fallback, storyrl_details)[0]


def compute_score_batch(
    data_sources: Sequence[Any] | None = None,
    solution_strs: Sequence[Any] | None = None,
    ground_truths: Sequence[Any] | None = None,
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    storyrl_config: str | None = None,
    storyrl_fallback: float | None = None,
    storyrl_details: bool | None = None,
    **kwargs: Any,
) -> list[float] | list[dict[str, float]]:
    """verl's legacy batch form (``reward_model.reward_manager=batch``,
    verl <= 0.7.0): lists in, one result per story out, scored in one
    reward call (batch and group normalisation included: groups are told
    apart by ``story_id``)."""
    if solution_strs is None:
        raise TypeError("compute_score_batch: solution_strs is required")
    stories = list(solution_strs)
    n = len(stories)
    truths = _column(ground_truths, n, "ground_truths")
    extras = _column(extra_infos, n, "extra_infos")
    reward = _core.reward_from_config(storyrl_config)
    fallback = _core.resolve_fallback(storyrl_fallback)
    contexts = [_sample_context(truths[i], extras[i], i) for i in range(n)]
    scored = _core.score_stories(reward, stories, _core.context_columns(contexts))
    return _results(reward, scored, fallback, storyrl_details)


def gdpo_settings(config: str | Path) -> dict[str, Any]:
    """verl's GDPO settings for a ``weighted`` reward config whose
    normalised components use ``normalize: group``: ``adv_estimator``,
    ``gdpo_reward_keys`` (the components with a non-zero weight, as
    :func:`compute_score` names them) and ``gdpo_reward_weights``. GDPO
    z-scores every key within its group, so each such component must be
    group- or range-normalised (a range is an affine map, which a z-score
    undoes); ValueError otherwise, naming the component."""
    from storyrl.rewards import load_reward_config

    reward = load_reward_config(config)  # not set up: no model is loaded
    terms = _gdpo_terms(reward)
    # The keys compute_score's dicts carry: the composite's log_extra columns.
    return {"adv_estimator": "gdpo", "gdpo_reward_keys": [f"{reward.name}/{name}" for name, _ in terms],
            "gdpo_reward_weights": [float(term.weight) for _, term in terms]}


def overrides(config: str | Path, verl_version: str = "0.9.1", *, function: str | None = None,
              gdpo: bool | None = None) -> list[str]:
    """The Hydra command-line overrides that make verl ``verl_version``
    score with the storyrl reward of ``config``: the reward function under
    the keys that version reads (``reward.custom_reward_function.*`` from
    0.7.1, the top-level ones before), named by package (``pkg://``, verl
    >= 0.7.0) or by file, and the reward manager or GDPO settings a batch-
    or group-normalised reward needs (``gdpo`` forces them on or off).
    ``function`` defaults to ``compute_score_async`` (reward loop) or, before
    0.7.1, ``compute_score`` / ``compute_score_batch`` (batch manager, for a
    batch-normalised reward)."""
    from packaging.version import Version

    from storyrl.rewards import load_reward_config

    version = Version(verl_version)
    config = Path(config).expanduser().resolve()
    normalised = _core.batch_normalized(load_reward_config(config))  # not set up: no model loads
    loop = version >= Version("0.7.1")
    prefix = "reward." if loop else ""
    if function is None:
        function = "compute_score_async" if loop else "compute_score_batch" if normalised else "compute_score"
    path = "pkg://storyrl.integrations.verl" if version >= Version("0.7.0") else Path(__file__).resolve()
    out = [f"{prefix}custom_reward_function.path={path}", f"{prefix}custom_reward_function.name={function}",
           # "++": add or replace; the reward_kwargs mapping is empty or absent in verl's YAML.
           f"++{prefix}custom_reward_function.reward_kwargs.storyrl_config={_hydra_value(config)}"]
    if function == "compute_score_batch":
        return [*out, "reward_model.reward_manager=batch"]
    if gdpo is None:
        gdpo = normalised and loop
    if gdpo:
        if version < Version("0.8.0"):
            raise ValueError(f"GDPO needs verl >= 0.8.0, not {verl_version}; before 0.7.1 use the batch manager "
                             "(compute_score_batch)")
        settings = gdpo_settings(config)
        keys = ",".join(settings["gdpo_reward_keys"])
        weights = ",".join(repr(w) for w in settings["gdpo_reward_weights"])
        out += [f"++{prefix}custom_reward_function.reward_kwargs.storyrl_gdpo=true",
                "algorithm.adv_estimator=gdpo", f"++algorithm.gdpo_reward_keys=[{keys}]",
                f"++algorithm.gdpo_reward_weights=[{weights}]"]
    return out


def _hydra_value(path: Path) -> str:
    """``path`` as a Hydra override value: quoted unless plain."""
    text = str(path)
    if all(c.isalnum() or c in "/._-" for c in text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _reward(config: str | None, gdpo: bool):
    """The reward for per-sample scoring: the configured one, or with
    ``gdpo`` for a group-normalised ``weighted`` reward, the same reward with
    its group normalisation left to verl (raw component values)."""
    if not isinstance(gdpo, bool):
        raise TypeError(f"storyrl_gdpo must be true or false, got {gdpo!r}")
    if not gdpo:
        reward = _core.reward_from_config(config)
        if _core.batch_normalized(reward):
            raise ValueError(_PER_SAMPLE.format(name=reward.name))
        return reward
    from storyrl.rewards import load_reward_config

    key = _config_key(config)
    with _RAW_LOCK:
        raw = _RAW.get(key)
        if raw is None:
            weighted = load_reward_config(key)
            if not _core.batch_normalized(weighted):
                raw = _core.reward_from_config(key)  # nothing to undo
            else:
                _gdpo_terms(weighted)
                components = [dataclasses.replace(c, normalize="none") if c.normalize == "group" else c
                              for c in weighted.args.components]
                raw = type(weighted)(dataclasses.replace(weighted.args, components=components)).setup()
            _RAW[key] = raw
    return raw


def _config_key(config: str | None) -> str:
    # As reward_from_config resolves it, so that both caches agree on the file.
    config = config or os.environ.get(_core.CONFIG_ENV)
    if not config:
        raise ValueError(f"no storyrl reward config: pass storyrl_config in reward_kwargs or set {_core.CONFIG_ENV}")
    return str(Path(config).expanduser().resolve())


def _gdpo_terms(reward) -> list[tuple[str, Any]]:
    """The (name, term) pairs GDPO weights: a weighted reward's components
    with a non-zero weight, each group- or range-normalised."""
    terms = getattr(reward, "terms", None)
    if reward.name != "weighted" or terms is None:
        raise ValueError(f"GDPO settings are for a 'weighted' reward's components, not {reward.name!r}")
    chosen = [(name, term) for name, term in terms.items() if term.weight != 0]
    for name, term in chosen:
        if term.normalize not in ("group", "range"):
            raise ValueError(
                f"component {name!r} has normalize: {term.normalize}, and GDPO z-scores every reward key within its "
                "group: set normalize: group (or range) on it, or weight 0 to log it only")
    if _core.batch_normalized(reward) and not any(term.normalize == "group" for _, term in chosen):
        raise ValueError("GDPO stands in for group normalisation; no component with a weight uses normalize: group")
    return chosen


async def _batcher(reward, max_batch_size: int, max_wait_ms: float) -> RequestBatcher:
    loop = asyncio.get_running_loop()
    batchers = _BATCHERS.setdefault(loop, {})
    key = (id(reward), max_batch_size, max_wait_ms)
    batcher = batchers.get(key)
    if batcher is None:
        def score(stories, contexts, prompts):
            return _core.score_stories(reward, stories, _core.context_columns(contexts))

        batcher = batchers[key] = RequestBatcher(score, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms)
        await batcher.start()
    return batcher


def _results(reward, scored: _core.Scored, fallback: float, details: bool | None) -> list:
    totals = scored.rewards(fallback)
    if details is None:
        details = bool(scored.components)
    if not details:
        return totals
    keys = _KEYS.setdefault(id(reward), tuple(sorted(scored.components)))
    components = scored.component_values(fallback)
    unscorable = scored.unscorable
    return [
        {"score": totals[i],
         **{k: components[k][i] if k in components else fallback for k in keys},
         "unscorable": float(unscorable[i])}
        for i in range(len(scored))
    ]


def _column(values: Sequence[Any] | None, n: int, name: str) -> list:
    if values is None:
        return [None] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"compute_score_batch: {name} has {len(values)} entries for {n} stories")
    return values


def _sample_context(ground_truth: Any, extra_info: Any, index: int) -> dict[str, Any]:
    """Context of one verl sample: ``extra_info``'s context keys, then the
    ground truth (the human story, or a mapping of context keys) on top."""
    if isinstance(ground_truth, np.ndarray) and ground_truth.ndim == 0:
        ground_truth = ground_truth.item()  # a scalar read back from parquet
    context = _core.label_context(extra_info, f"sample {index}: extra_info") if isinstance(extra_info, Mapping) else {}
    context.update(_core.label_context(ground_truth, f"sample {index}: ground_truth"))
    return context
