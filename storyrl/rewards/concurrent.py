"""Async reward functions: rewards that run concurrently with each other.

TRL's GRPO/RLOO trainers await every *async* reward function of a step
together (``asyncio.gather`` on one event-loop thread), and storyrl's PPO
does the same (:func:`storyrl.training.storyteller.rl.ppo.rewards.call_rewards`). A
storyrl reward is synchronous: TRL calls it after the previous one finished.
:class:`AsyncReward` gives it an ``async __call__`` that runs the reward in a
worker thread of its own, so two model rewards (torch releases the GIL while
it computes) or a model reward next to a remote one overlap. Each reward
keeps one thread, so its models are always used from the same thread.

In an RL config, ``async_rewards: true`` wraps every reward this way
(:class:`~storyrl.rewards.remote.RemoteReward` is async already). It helps
when a run has several rewards that spend their time in torch or waiting on
the network; a single reward gains nothing.

:func:`run_sync` runs a coroutine to completion from synchronous code, on a
private event loop in a daemon thread, so it also works from a thread whose
own loop is running (TRL's reward loop, verl's async reward manager), where
``asyncio.run`` refuses.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["AsyncReward", "is_async_reward", "run_sync"]

T = TypeVar("T")


def is_async_reward(func: Any) -> bool:
    """Whether calling ``func`` returns a coroutine (TRL's
    ``is_async_callable``): a coroutine function, a ``functools.partial`` of
    one, or an object whose ``__call__`` is ``async def``."""
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def _private_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        # After a fork (Ray, DataLoader workers) the parent's loop thread is gone.
        if _LOOP is None or _LOOP[0] != os.getpid() or _LOOP[1].is_closed():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()

            threading.Thread(target=run, name="storyrl-reward-loop", daemon=True).start()
            ready.wait()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """The result of ``coro``, run on storyrl's private event loop thread
    (blocking the calling thread, whatever loop it runs)."""
    loop = _private_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # a sync path called from a coroutine on the private loop itself
        coro.close()
        raise RuntimeError("run_sync called from storyrl's reward loop; await the coroutine instead")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


class AsyncReward:
    """``reward`` (a storyrl Reward or any sync TRL reward function) as an
    async TRL reward function: each call runs the reward in the wrapper's one
    worker thread. ``__name__`` (TRL's column name) is the reward's; the
    keywords, ``log_extra`` and ``log_metric`` included, are passed on as
    they are; other attributes (``score``, ``stats``, ``setup``, ...) are the
    reward's. Picklable when the reward is (the thread is not pickled)."""

    def __init__(self, reward: Any) -> None:
        if is_async_reward(reward):
            raise TypeError(f"{_name(reward)!r} is async already")
        if not callable(reward):
            raise TypeError(f"a reward function is callable, got {type(reward).__name__}")
        self.reward = reward
        self.__name__ = _name(reward)
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"storyrl-{self.__name__}")
            return self._executor

    async def __call__(self, prompts=None, completions=None, **kwargs: Any) -> list[float | None]:
        call = functools.partial(self.reward, prompts=prompts, completions=completions, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._worker(), call)

    def __getattr__(self, name: str) -> Any:
        reward = self.__dict__.get("reward")
        if reward is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(reward, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"reward": self.reward, "__name__": self.__name__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._executor = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AsyncReward({self.reward!r})"


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or getattr(func, "name", None) or type(func).__name__
