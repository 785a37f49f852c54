"""storyrl rewards beyond one machine: verl, OpenRLHF and an HTTP reward server.

Users who outgrow ``accelerate`` run verl or OpenRLHF on Ray. The same storyrl
reward config (``configs/rewards/*.yaml``, ``reward: <name>`` plus options)
scores their rollouts:

* verl: ``reward.custom_reward_function`` names
  :mod:`storyrl.integrations.verl` (``compute_score_async`` in verl's reward
  loop, 0.7.1+; ``compute_score_batch`` with the batch manager before);
  :func:`storyrl.integrations.verl.overrides` prints the settings per version.
* OpenRLHF: ``--reward.remote_url`` (``--remote_rm_url`` before 0.10.2) = the
  file of :mod:`storyrl.integrations.openrlhf` (its ``reward_func``), or the
  URL of ``storyrl serve --config REWARD.yaml``
  (:mod:`storyrl.integrations.server`), which batches concurrent requests
  from many trainer nodes onto one reward model.

What they share (the reward built once per process, the per-story context,
scoring with a fallback for unscorable stories, :data:`STATS`) is
:mod:`storyrl.integrations.scoring`; its public names are re-exported here,
loaded on first use. Patch them there: the adapters look them up in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "CONFIG_ENV",
    "CONTEXT_KEYS",
    "FALLBACK_ENV",
    "STATS",
    "Scored",
    "batch_normalized",
    "context_columns",
    "label_context",
    "resolve_fallback",
    "reward_from_config",
    "score_stories",
    "strip_end_markers",
]

if TYPE_CHECKING:
    from storyrl.integrations.scoring import (
        CONFIG_ENV,
        CONTEXT_KEYS,
        FALLBACK_ENV,
        STATS,
        Scored,
        batch_normalized,
        context_columns,
        label_context,
        resolve_fallback,
        reward_from_config,
        score_stories,
        strip_end_markers,
    )


def __getattr__(name: str) -> Any:
    # Lazy, so that the guards and the batcher import no reward code.
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from storyrl.integrations import scoring

    return getattr(scoring, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
