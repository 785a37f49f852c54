"""Async rewards in the RL trainers: AsyncReward, ``async_rewards: true``,
the remote reward inside TRL's GRPO and storyrl's PPO, and a reward server
that stays down stopping a run with its message.

Concurrency is shown with a barrier, not timing: two rewards that each wait
for the other can only finish when they run at the same time."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)
from storyrl.rewards import Reward, create_reward, register_reward
from storyrl.rewards.base import FatalRewardError
from storyrl.rewards.concurrent import AsyncReward, is_async_reward

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("trl")

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
BARRIER = {"barrier": threading.Barrier(2, timeout=30), "threads": []}

pytestmark = pytest.mark.usefixtures("one_thread_module")


@register_reward()
class _Words(Reward):
    """Test reward: a tenth of the story's word count (always scorable)."""

    name = "test_async_words"

    def _score_batch(self, stories, **context):
        return np.array([len(s.split()) / 10 for s in stories])


class _Waits(Reward):
    """Waits at BARRIER for the other reward, then scores words / 10."""

    def _score_batch(self, stories, **context):
        BARRIER["threads"].append((self.name, threading.current_thread().name))
        BARRIER["barrier"].wait()
        return np.array([len(s.split()) / 10 for s in stories])


@register_reward()
class _WaitsA(_Waits):
    """Test reward: waits for test_async_wait_b."""

    name = "test_async_wait_a"


@register_reward()
class _WaitsB(_Waits):
    """Test reward: waits for test_async_wait_a."""

    name = "test_async_wait_b"


class _FailsLater(Reward):
    """Scores words / 10 on its first call and raises ``error`` from then on."""

    error: type[Exception] = ValueError

    def score(self, stories, **context):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 1:
            raise self.error("the reward broke on call 2")
        return np.array([len(s.split()) / 10 if isinstance(s, str) else np.nan for s in stories])


@register_reward()
class _FatalLater(_FailsLater):
    """Test reward: a FatalRewardError from its second call on."""

    name = "test_async_fatal_later"
    error = FatalRewardError


@register_reward()
class _ValueErrorLater(_FailsLater):
    """Test reward: a ValueError from its second call on."""

    name = "test_async_value_error_later"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    BARRIER.update(barrier=threading.Barrier(2, timeout=30), threads=[])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    images = [str(p) for p in write_images(root / "images", 4)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k : k + 2]),
                                        "images": images[:3]}) + "\n" for k in range(4)))
    return {"data": str(data), "model": save_tiny_llama(root / "llama", TEXTS)}


def rl_config(assets, out, rewards, algorithm="grpo", **extra):
    from storyrl.training.storyteller.rl.config import RLConfig

    section = {"per_device_train_batch_size": 4, "max_completion_length": 8, "learning_rate": 1e-3,
               "logging_steps": 1, "save_strategy": "no", "num_generations": 2} if algorithm == "grpo" else \
        {"per_device_train_batch_size": 4, "num_mini_batches": 2, "response_length": 8, "num_ppo_epochs": 1}
    return RLConfig.from_mapping({"algorithm": algorithm, "model": assets["model"], "data": assets["data"],
                                  "output_dir": str(out), "rewards": rewards, "max_steps": 1, "prompt": "P1",
                                  "setting": "text", algorithm: section, **extra})


class FakeServer:
    """/health answers; /get_reward answers words / 10 except for the
    stories ``fails(label)`` picks, or always ``status``."""

    def __init__(self, status=None, fails=lambda label: False):
        self.status, self.fails = status, fails

    async def get_reward(self, request):
        from starlette.responses import JSONResponse

        body = await request.json()
        if self.status or any(self.fails(label or {}) for label in body["labels"]):
            return JSONResponse({"detail": "reward model crashed"}, status_code=self.status or 500)
        stories = [q[len(p or ""):] for q, p in zip(body["query"], body["prompts"] or [None] * len(body["query"]))]
        return JSONResponse({"rewards": [len(s.split()) / 10 for s in stories],
                             "extra_logs": {"unscorable": [0.0] * len(stories)}})

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        return Starlette(routes=[Route("/get_reward", self.get_reward, methods=["POST"]),
                                 Route("/health", lambda request: JSONResponse({"status": "ok"}))])


# -- AsyncReward ------------------------------------------------------------------------------------


def test_async_reward_calls_the_reward_in_its_own_thread():
    reward = create_reward("repetition")
    wrapped = AsyncReward(reward)
    assert is_async_reward(wrapped) and not is_async_reward(reward) and wrapped.__name__ == "repetition"
    stories = ["The dog ran. The dog ran to the lake.", "One sentence.", "A cat sat. A dog sat. A cat ran."]
    local_logs, async_logs = ({}, {}), ({}, {})

    def call(fn, logs):
        return fn(prompts=["p"] * 3, completions=stories, log_extra=logs[0].__setitem__,
                  log_metric=logs[1].__setitem__)

    expected = call(create_reward("repetition"), local_logs)
    assert asyncio.run(call(wrapped, async_logs)) == expected and expected[1] is None
    assert async_logs == local_logs and "repetition/unscorable_frac" in async_logs[1]
    assert wrapped.stats["scored"] == 2 and wrapped.chunk_size == 4  # the reward's attributes

    seen = []
    spy = AsyncReward(lambda prompts=None, completions=None, **kw: seen.append(threading.get_ident()) or [1.0])
    for _ in range(3):
        asyncio.run(spy(prompts=["p"], completions=["x"]))
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()  # one worker thread, not the caller's

    copy = pickle.loads(pickle.dumps(wrapped))
    assert copy.__name__ == "repetition" and asyncio.run(call(copy, ({}, {}))) == expected
    with pytest.raises(TypeError, match="async already"):
        AsyncReward(create_reward("remote", url="http://h:1"))


def test_sync_rewards_run_one_after_the_other():
    """The premise of the concurrency tests: called in turn, the first waits in vain."""
    BARRIER["barrier"] = threading.Barrier(2, timeout=0.2)
    reward = create_reward("test_async_wait_a")
    with pytest.raises(threading.BrokenBarrierError):
        reward._score_batch(["a b"])


def test_ppo_awaits_async_rewards_together():
    from storyrl.training.storyteller.rl.ppo.rewards import call_rewards

    funcs = [AsyncReward(create_reward("test_async_wait_a")), AsyncReward(create_reward("test_async_wait_b")),
             create_reward("test_async_words")]
    rows = [{"prompt": "p", "story_id": f"s{k}"} for k in range(2)]
    batch = call_rewards(funcs, [f.__name__ for f in funcs], rows, ["p", "p"], ["a b", "a b c"], [[1], [2]])
    assert batch.values.tolist() == [[pytest.approx(0.2)] * 3, [pytest.approx(0.3)] * 3]
    assert len({thread for _, thread in BARRIER["threads"]}) == 2


@pytest.mark.parametrize("kind", ["sync", "async", "wrapped"])
def test_ppo_passes_a_fatal_reward_error_on_after_one_call(kind):
    """Retrying a server that is down for good, completion by completion,
    only delays the stop: the error comes out as it is, after one call."""
    from storyrl.training.storyteller.rl.ppo.rewards import call_rewards

    class ServerGone(FatalRewardError):
        pass

    calls = []

    def gone(prompts=None, completions=None, **kwargs):
        calls.append(len(completions))
        raise ServerGone("down for good")

    async def agone(prompts=None, completions=None, **kwargs):
        return gone(prompts, completions, **kwargs)

    func = {"sync": gone, "async": agone, "wrapped": AsyncReward(gone)}[kind]
    funcs = [create_reward("test_async_words"), func]
    rows = [{"prompt": "p", "story_id": f"s{k}"} for k in range(3)]
    with pytest.raises(ServerGone, match="down for good"):
        call_rewards(funcs, ["words", "gone"], rows, ["p"] * 3, ["a", "a b", "a b c"], [[1], [2], [3]])
    assert calls == [3]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_fatal_reward_error_stops_the_run_without_final(assets, tmp_path, algorithm):
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import RunFailedError

    config = rl_config(assets, tmp_path / "out", ["test_async_fatal_later"], algorithm, max_steps=2)
    with pytest.raises(RunFailedError, match="^stopped: the reward broke on call 2$") as caught:
        train(config, progress=False)
    assert isinstance(caught.value.__cause__, FatalRewardError)
    assert not (tmp_path / "out" / "final").exists()


def test_other_errors_of_a_reward_are_not_a_stopped_run(assets, tmp_path):
    """Only a FatalRewardError is a clean stop; a bug keeps its type and traceback."""
    from storyrl.training.storyteller.rl.train import train
    from storyrl.training.runs import RunFailedError

    config = rl_config(assets, tmp_path / "out", ["test_async_value_error_later"], "grpo", max_steps=2)
    with pytest.raises(ValueError, match="the reward broke on call 2") as caught:
        train(config, progress=False)
    assert not isinstance(caught.value, RunFailedError)
    assert not (tmp_path / "out" / "final").exists()


def test_async_rewards_run_concurrently_under_trl(assets, tmp_path):
    """GRPO (TRL's own async path) with two rewards that wait for each other."""
    from storyrl.training.storyteller.rl.train import train

    config = rl_config(assets, tmp_path / "out", ["test_async_wait_a", "test_async_wait_b"], async_rewards=True)
    result = train(config, progress=False)
    assert result.steps == 1
    (entry,) = [e for e in result.history if "loss" in e]
    assert entry["rewards/test_async_wait_a/mean"] == entry["rewards/test_async_wait_b/mean"]
    names = {name for name, _ in BARRIER["threads"]}
    assert names == {"test_async_wait_a", "test_async_wait_b"}
    assert len({thread for _, thread in BARRIER["threads"]}) == 2  # each reward in its own thread
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["step"] == 1 and all(set(s["rewards"]) == names for s in samples[0]["samples"])


def test_async_rewards_is_a_checked_option(assets, tmp_path):
    with pytest.raises(TypeError, match="async_rewards"):
        rl_config(assets, tmp_path / "o", ["test_async_words"], async_rewards="yes")
    config = rl_config(assets, tmp_path / "o", ["test_async_words"])
    assert config.async_rewards is False and not is_async_reward(config.reward_functions(config.build_rewards())[0])


# -- the remote reward in the trainers --------------------------------------------------------------


def test_grpo_with_a_remote_reward_logs_what_the_local_reward_gives(assets, tmp_path):
    from storyrl.integrations.server import create_app, run_in_thread
    from storyrl.training.storyteller.rl.train import train

    with run_in_thread(create_app(create_reward("test_async_words"))) as url:
        rewards = ["test_async_words", {"reward": "remote", "url": url, "label": "remote_words", "chunk_size": 3,
                                         "send_context": ["story_id"]}]
        result = train(rl_config(assets, tmp_path / "out", rewards, reward_weights=[1.0, 0.0]), progress=False)
    (entry,) = [e for e in result.history if "loss" in e]
    for stat in ("mean", "std"):
        local, remote = entry[f"rewards/test_async_words/{stat}"], entry[f"rewards/remote_words/{stat}"]
        assert math.isfinite(local) and remote == local, stat
    assert entry["remote_words/unscorable_frac"] == 0.0
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    for sample in samples[0]["samples"]:
        assert sample["rewards"]["remote_words"] == sample["rewards"]["test_async_words"] == \
            pytest.approx(len(sample["story"].split()) / 10)


def test_ppo_masks_only_the_completions_the_server_failed(tmp_path):
    from datasets import Dataset
    from tiny_models import chat_tokenizer, tiny_llama

    from storyrl.integrations.server import run_in_thread
    from storyrl.training.storyteller.rl.ppo import PPOTrainer
    from storyrl.training.storyteller.rl.ppo.config import PPOConfig

    server = FakeServer(fails=lambda label: label.get("story_id") == "s1")
    prompt = "Tell me a story about these pictures."
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}]] * 4,
                              "story_id": [f"s{k}" for k in range(4)]})
    tokenizer = chat_tokenizer([*TEXTS, prompt])
    args = PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_mini_batches=2,
                     num_ppo_epochs=1, max_steps=2, response_length=8, learning_rate=1e-3, save_steps=None)
    with run_in_thread(server.app()) as url:
        reward = create_reward("remote", url=url, chunk_size=1, retries=0)
        result = PPOTrainer(tiny_llama(tokenizer), [reward], args, data, processing_class=tokenizer).train()
    for record in result.history:  # each step holds s1 once among 4 stories
        assert record["ppo/masked_frac"] == pytest.approx(0.25)
        assert record["rewards/remote/errors"] == 0.0 and math.isfinite(record["rewards/remote/mean"])
        assert math.isfinite(record["loss/policy"])
    assert reward.stats["reasons"] == {"HTTP 500": 2}


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_server_that_stays_down_stops_the_run_with_its_message(assets, tmp_path, algorithm):
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.integrations.server import run_in_thread

    with run_in_thread(FakeServer(status=503).app()) as url:  # healthy at setup, failing every request
        config = rl_config(assets, tmp_path / "out", [{"reward": "remote", "url": url, "retries": 1,
                                                       "backoff_s": 0.01, "max_consecutive_failures": 1}],
                           algorithm)
        config.to_yaml(tmp_path / "rl.yaml")
        result = CliRunner().invoke(main, ["train", "rl", "--config", str(tmp_path / "rl.yaml"), "-q"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert f"{url}/get_reward" in errors[0] and "HTTP 503" in errors[0] and "storyrl serve" in errors[0]
    assert not (tmp_path / "out" / "final").exists()


def test_a_dead_server_fails_before_training(assets, tmp_path):
    import socket

    from storyrl.training.storyteller.rl.train import train

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    config = rl_config(assets, tmp_path / "out", [{"reward": "remote", "url": url, "retries": 0}])
    with pytest.raises(ValueError, match="no reward server answers at"):
        train(config, progress=False)
    assert not Path(config.output_dir, "rl_config.yaml").exists()
