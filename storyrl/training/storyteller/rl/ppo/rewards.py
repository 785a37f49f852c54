"""Calling reward functions for PPO, TRL style, and turning their values
into one score per story.

Each function is called once per step with TRL's keywords (``prompts``,
``completions``, ``completion_ids``, ``log_metric``, ``log_extra``,
``trainer_state=None``) and every dataset column but ``prompt``. A function
that raises on the batch is called again one completion at a time, so only
the completions it cannot score get None; one that fails for every
completion is an error (a broken reward, not a bad story), and a
:class:`~storyrl.rewards.base.FatalRewardError` (a reward server down for
good, a rejected token) is passed on at once: retrying cannot mend it.

As in TRL, the synchronous functions are called first, in order, then every
async one (``async def __call__``, e.g. the ``remote`` reward or
:class:`~storyrl.rewards.concurrent.AsyncReward`) concurrently, on storyrl's
reward event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from storyrl.rewards.base import FatalRewardError
from storyrl.rewards.concurrent import is_async_reward, run_sync

__all__ = ["RewardBatch", "call_rewards", "combine_scores", "reward_name"]

logger = logging.getLogger(__name__)


def reward_name(func: Any) -> str:
    """The name TRL gives a reward function (its ``__name__``)."""
    return getattr(func, "__name__", None) or getattr(func, "name", None) or type(func).__name__


@dataclass
class RewardBatch:
    """One step's reward values: ``values`` (stories, functions) with NaN
    for None; ``metrics`` the means of what the functions logged through
    ``log_metric``; ``extras`` the columns given to ``log_extra``;
    ``errors`` the completions each function raised on."""

    values: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, list] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)


def _call_one(func, name: str, kwargs: dict, n: int) -> tuple[list[float], int]:
    try:
        values = list(func(**kwargs))
    except FatalRewardError:
        raise
    except Exception as exc:  # isolate the completion(s) that break the batch
        _warn_batch(name, exc)
    else:
        return _checked(name, values, n), 0
    values, errors, last = [], 0, None
    for i in range(n):
        try:
            values.append(_first(func(**_one(kwargs, i, n))))
        except FatalRewardError:
            raise
        except Exception as one_exc:
            errors, last = errors + 1, one_exc
            values.append(math.nan)
    return _finish(name, values, n, errors, last)


async def _acall_one(func, name: str, kwargs: dict, n: int) -> tuple[list[float], int]:
    """_call_one for an async reward function."""
    try:
        values = list(await func(**kwargs))
    except FatalRewardError:
        raise
    except Exception as exc:  # isolate the completion(s) that break the batch
        _warn_batch(name, exc)
    else:
        return _checked(name, values, n), 0
    values, errors, last = [], 0, None
    for i in range(n):
        try:
            values.append(_first(await func(**_one(kwargs, i, n))))
        except FatalRewardError:
            raise
        except Exception as one_exc:
            errors, last = errors + 1, one_exc
            values.append(math.nan)
    return _finish(name, values, n, errors, last)


def _warn_batch(name: str, exc: Exception) -> None:
    logger.warning("reward %r raised on a batch (%s: %s); scoring its completions one by one",
                   name, type(exc).__name__, exc)


def _one(kwargs: dict, i: int, n: int) -> dict:
    return {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}


def _first(got: Any) -> Any:
    got = list(got)
    return got[0] if len(got) == 1 else math.nan


def _finish(name: str, values: list, n: int, errors: int, last: Exception | None) -> tuple[list[float], int]:
    if errors >= n:
        raise RuntimeError(f"reward {name!r} failed for every completion of the step: "
                           f"{type(last).__name__}: {last}") from last
    return _checked(name, values, n), errors


def _checked(name: str, values: list, n: int) -> list[float]:
    if len(values) != n:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {n} completions")
    return [math.nan if v is None else float(v) for v in values]


def call_rewards(funcs, names: list[str], rows: list[dict], prompts: list, completions: list,
                 completion_ids: list) -> RewardBatch:
    """Every function's values for the stories of ``rows`` (see the module docs)."""
    n = len(completions)
    metrics: dict[str, list[float]] = defaultdict(list)
    extras: dict[str, list] = {}
    columns = sorted({k for row in rows for k in row} - {"prompt"})
    kwargs: dict[str, Any] = {k: [row.get(k) for row in rows] for k in columns}
    kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=None,
                  log_metric=lambda key, value: metrics[key].append(float(value)),
                  log_extra=lambda column, values: extras.__setitem__(column, list(values)))
    out = torch.full((n, len(funcs)), math.nan)
    errors = {}
    concurrent = [i for i, func in enumerate(funcs) if is_async_reward(func)]
    for i, (func, name) in enumerate(zip(funcs, names)):
        if i not in concurrent:
            values, errors[name] = _call_one(func, name, kwargs, n)
            out[:, i] = torch.tensor(values, dtype=torch.float32)
    if concurrent:
        async def together():
            return await asyncio.gather(*(_acall_one(funcs[i], names[i], kwargs, n) for i in concurrent),
                                        return_exceptions=True)

        results = run_sync(together())
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
        for i, (values, errors[names[i]]) in zip(concurrent, results):
            out[:, i] = torch.tensor(values, dtype=torch.float32)
    return RewardBatch(out, {k: sum(v) / len(v) for k, v in metrics.items() if v}, extras, errors)


def combine_scores(values: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, valid)``: the weighted sum per story, and whether every
    function with a non-zero weight scored it. Unlike TRL's GRPO (which sums
    the functions that did score), a story missing a term is not scored at
    all: its sum would be a different objective. Invalid stories score 0."""
    used = weights != 0
    valid = ~torch.isnan(values[:, used]).any(dim=1)
    scores = torch.where(used, torch.nan_to_num(values, nan=0.0), 0.0) @ weights
    return torch.where(valid, scores, 0.0), valid
