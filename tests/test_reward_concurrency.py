"""storyrl.rewards.concurrent without a trainer: which functions count as
async, AsyncReward's one worker thread and its attributes, and run_sync
after a fork."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import os
import signal
import threading
import time

import pytest

from storyrl.rewards.concurrent import AsyncReward, is_async_reward, run_sync


async def _async_score(prompts=None, completions=None, scale=1.0, **kwargs):
    return [scale] * len(completions)


def _sync_score(prompts=None, completions=None, scale=1.0, **kwargs):
    return [scale] * len(completions)


class _AsyncCall:
    async def __call__(self, prompts=None, completions=None, **kwargs):
        return [1.0] * len(completions)


def test_partials_of_async_functions_are_async():
    """TRL's is_async_callable sees through partials, nested ones included;
    wrapping one would hand TRL a coroutine as a reward value."""
    class Partial(functools.partial):  # a __call__ of its own: not flattened into the outer partial
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    nested = [functools.partial(Partial(_async_score), scale=2.0), functools.partial(Partial(_AsyncCall()), x=1)]
    assert all(isinstance(func.func, functools.partial) for func in nested)
    partials = [functools.partial(_async_score, scale=2.0), functools.partial(_AsyncCall()), *nested]
    for func in partials:
        assert is_async_reward(func), func
        with pytest.raises(TypeError, match="async already"):
            AsyncReward(func)
    assert not is_async_reward(functools.partial(functools.partial(_sync_score), scale=2.0))
    assert asyncio.run(AsyncReward(functools.partial(_sync_score, scale=2.0))(completions=["a"])) == [2.0]


def test_overlapping_calls_of_one_wrapper_share_its_one_thread():
    """A reward's models are used from one thread, also when two calls of the
    same wrapper overlap: the second starts once the first is done."""
    lock, threads, overlapped = threading.Lock(), [], []
    second_started = threading.Event()

    def reward(prompts=None, completions=None, **kwargs):
        with lock:
            threads.append(threading.get_ident())
            first = len(threads) == 1
        if first:  # with a second thread, the other call would start meanwhile
            overlapped.append(second_started.wait(0.5))
        else:
            second_started.set()
        return [1.0] * len(completions)

    wrapped = AsyncReward(reward)

    async def both():
        return await asyncio.gather(wrapped(completions=["a"]), wrapped(completions=["b", "c"]))

    assert asyncio.run(both()) == [[1.0], [1.0, 1.0]]
    assert overlapped == [False] and len(threads) == 2 and threads[0] == threads[1] != threading.get_ident()


def test_dunders_are_the_wrappers_not_the_rewards():
    """Only plain attributes are the reward's: a deep copy is an AsyncReward
    (of a copy of the reward), and nothing unwraps it to the sync reward."""
    class Inner:
        def __init__(self):
            self.__name__, self.__wrapped__, self.copies = "inner", _sync_score, 0

        def __call__(self, prompts=None, completions=None, **kwargs):
            return [1.0] * len(completions)

        def __deepcopy__(self, memo):
            fresh = Inner()
            fresh.copies = self.copies + 1
            return fresh

    wrapped = AsyncReward(Inner())
    copied = copy.deepcopy(wrapped)
    assert isinstance(copied, AsyncReward) and copied.__name__ == "inner" and copied.copies == 1
    assert asyncio.run(copied(completions=["a"])) == [1.0]
    assert inspect.unwrap(wrapped) is wrapped and is_async_reward(wrapped)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_run_sync_in_a_forked_child_does_not_wait_for_the_parents_loop():
    """Ray and DataLoader workers fork: the parent's loop thread is not in
    the child, so the child starts a loop of its own."""
    async def answer():
        await asyncio.sleep(0)
        return 42

    assert run_sync(answer()) == 42  # the parent's loop exists before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe and the exit status, never return into pytest
        code = 1
        try:
            os.close(read)
            os.write(write, str(run_sync(answer())).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail("run_sync hung in the forked child")
        time.sleep(0.05)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"42"
    assert os.waitstatus_to_exitcode(status) == 0
