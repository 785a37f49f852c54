"""storyrl rewards as verl custom reward functions.

verl loads ``custom_reward_function.path`` (a Python file) and calls the
function named by ``custom_reward_function.name``, adding the mapping
``custom_reward_function.reward_kwargs`` to every call's keyword arguments::

    custom_reward_function:
      path: /path/to/site-packages/storyrl/integrations/verl.py
      name: compute_score                 # verl's naive / prime reward managers
      reward_kwargs:
        storyrl_config: /path/to/configs/rewards/repetition.yaml
        storyrl_fallback: 0.0             # optional

The path is printed by ``python -c "import storyrl.integrations.verl as m;
print(m.__file__)"``; a file of your own holding ``from
storyrl.integrations.verl import compute_score`` works too. Without
``storyrl_config`` the config comes from the ``STORYRL_REWARD_CONFIG``
environment variable (Ray workers must see it: set it in Ray's runtime env;
``reward_kwargs`` travel with verl's config and need nothing else).

With ``reward_model.reward_manager=batch`` use ``name: compute_score_batch``:
verl's batch manager passes lists (``data_sources``, ``solution_strs``,
``ground_truths``, ``extra_infos``) and takes a list back; one reward call
scores the whole batch, which is what a model-based reward wants.

What storyrl reads from a verl sample: ``solution_str`` is the story;
``ground_truth`` (``reward_model.ground_truth`` in verl's data) is the human
story (``reference``, for d_HM) or a mapping with any of
:data:`storyrl.integrations.CONTEXT_KEYS`; ``extra_info`` may carry
``story_id``, ``images`` / ``story_images`` (image paths, one per position),
``image_ids``, ``noun_phrases`` and ``reference``. ``data_source`` is not used.
A ``weighted`` reward normalised per ``group`` tells the groups apart by
``story_id`` (verl does not pass the prompt): give it in ``extra_info``.
Such a reward (``normalize: batch`` or ``group``) needs
``compute_score_batch``; ``compute_score`` refuses it.

Return value: a float; or, when the reward logs per-sample components (the
composite ``dhm`` / ``weighted`` rewards) or ``storyrl_details=True``, a dict
``{"score": total, <component>: value, ..., "unscorable": 0.0 | 1.0}``,
which verl's managers read as the reward (``"score"``) plus extra info they
log. verl cannot take None or NaN: an unscorable story gets the fallback
(default 0.0), is counted in :data:`storyrl.integrations.STATS` and flagged
by ``unscorable``; an unscorable component gets the fallback too. A dict has
the same keys on every call for a given reward (verl stacks them per key).

The reward is built and its models loaded once per process (and config
file), on the first call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import storyrl.integrations as _core

__all__ = ["compute_score", "compute_score_batch"]

# Component keys of a reward's dict results, fixed by its first call so that
# every sample verl collects has the same keys.
_KEYS: dict[int, tuple[str, ...]] = {}


def compute_score(
    data_source: Any = None,
    solution_str: Any = None,
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    storyrl_config: str | None = None,
    storyrl_fallback: float | None = None,
    storyrl_details: bool | None = None,
    **kwargs: Any,
) -> float | dict[str, float]:
    """verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None, **kwargs)`` for one story. Keyword arguments verl adds
    that storyrl does not use are ignored. A reward normalised over the
    batch or prompt groups is refused (one story is no batch): use
    :func:`compute_score_batch`."""
    reward = _core.reward_from_config(storyrl_config)
    if _core.batch_normalized(reward):
        raise ValueError(
            f"reward {reward.name!r} normalises over the batch or prompt groups, and verl's compute_score sees "
            "one story at a time: use compute_score_batch with reward_model.reward_manager=batch"
        )
    (result,) = compute_score_batch(
        [data_source], [solution_str], [ground_truth], [extra_info],
        storyrl_config=storyrl_config, storyrl_fallback=storyrl_fallback, storyrl_details=storyrl_details,
    )
    return result


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
    """verl's batch form (``reward_manager=batch``): lists in, one result per
    story out, scored in one reward call."""
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
    totals = scored.rewards(fallback)
    details = storyrl_details if storyrl_details is not None else bool(scored.components)
    if not details:
        return totals
    keys = _KEYS.setdefault(id(reward), tuple(sorted(scored.components)))
    components = scored.component_values(fallback)
    unscorable = scored.unscorable
    return [
        {"score": totals[i],
         **{k: components[k][i] if k in components else fallback for k in keys},
         "unscorable": float(unscorable[i])}
        for i in range(n)
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
    context = _core.label_context(extra_info, f"sample {index}: extra_info") if isinstance(extra_info, Mapping) else {}
    context.update(_core.label_context(ground_truth, f"sample {index}: ground_truth"))
    return context
