"""``storyrl serve``: real HTTP on the loopback interface. Answers equal
``reward.score`` on the same stories, concurrent requests are batched onto
one reward call each answered with its own scores, bad requests get a 4xx
with a reason and a failing reward a 5xx, and the server keeps serving.
Every wait is bounded (``WAIT_S`` for an answer), so a server that waits far
too long -- a batcher reading ``max_wait_ms`` as seconds would hold each
request 10 s -- fails a test instead of holding the suite."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO

from storyrl.cli import main
from storyrl.integrations.server import create_app, run_in_thread
from storyrl.rewards import Reward, create_reward, register_reward
from storyrl.rewards.base import RewardError
from storyrl.rewards.repetition import Repetition

STORIES = [
    "The dog ran to the park. The dog ran to the lake. He was happy.",
    "We went to the beach. The sun was hot. We swam all day.",
    "one sentence only.",
    "A cat sat. A cat sat. A cat sat.",
]


def expected(stories, fallback=0.0):
    return [fallback if math.isnan(v) else float(v) for v in create_reward("repetition").score(stories)]


def story(i: int) -> str:
    """Distinct stories with distinct repetition scores."""
    return f"Story {i} begins here. " + " ".join(f"Day {k} came and day {k} went." for k in range(i % 5 + 1))


class Spy(Repetition):
    """Repetition that records every call's batch size; a batch with a
    "WAIT" story waits for ``gate``; it can be broken, or fail every batch
    holding a story with "POISON"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.broken = False

    def score(self, stories, **context):
        self.calls.append(len(stories))
        if any("WAIT" in s for s in stories if isinstance(s, str)):
            assert self.gate.wait(20)
        if self.broken:
            raise RuntimeError("GPU on fire")
        if any("POISON" in s for s in stories if isinstance(s, str)):
            raise RewardError("poisoned batch")
        return super().score(stories, **context)


@register_reward()
class _Unloadable(Reward):
    """Its model cannot load: setup fails."""

    name = "test_serve_unloadable"

    def _setup(self):
        raise OSError("checkpoint runs/missing not found")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STORYRL_REWARD_FALLBACK", raising=False)


#: The longest a test waits for one answer (unless it sets its own): far above a normal answer here
#: (milliseconds), below the 10 s a batcher reading the default max_wait_ms (10) as seconds would take.
WAIT_S = 8.0


def post(url, body, **kwargs):
    kwargs.setdefault("timeout", WAIT_S)
    return httpx.post(f"{url}/get_reward", json=body, **kwargs)


def _join(*threads: threading.Thread, timeout: float = 2 * WAIT_S) -> None:
    """Waits for the threads; fails (rather than going on) if one is still running."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.01))
        assert not thread.is_alive(), f"{thread.name} still waits after {timeout} s"


def test_answers_equal_reward_score(monkeypatch):
    reward = create_reward("repetition")
    with run_in_thread(create_app(reward, fallback=-1.0)) as url:
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        prompts = [f"<s>[INST] Tell story {i} [/INST]" for i in range(len(STORIES))]
        queries = [p + s + "</s>" for p, s in zip(prompts, STORIES)]
        labels = [None, "a human story", {"story_id": "x"}, None]
        r = post(url, {"query": queries, "prompts": prompts, "labels": labels})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["rewards"] == pytest.approx(expected(STORIES, fallback=-1.0))
        assert answer["scores"] == answer["rewards"]
        assert answer["extra_logs"] == {"unscorable": [0.0, 0.0, 1.0, 0.0]}
        # OpenRLHF's old protocol: query only; an empty batch is fine too
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES, -1.0))
        assert post(url, {"query": []}).json() == {"rewards": [], "scores": [], "extra_logs": {"unscorable": []}}
        info = httpx.get(f"{url}/info").json()
        # without a token nobody is authenticated: the reward's options (file paths...) stay hidden
        assert info["reward"] == "repetition" and "config" not in info
        assert info["fallback"] == -1.0 and info["stats"]["fallback"] == 2


def test_composite_reward_sends_its_components(tmp_path):
    dhm = create_reward("dhm", dimensions=["repetition"])
    human = ["A boy went out. He played. Then he went home.", "The family drove. Everyone swam. It was good.",
             "It rained. We stayed in.", "The cat slept. Later it ate. Then it slept again."]
    want = dhm.score(STORIES, reference=human)
    with run_in_thread(create_app(create_reward("dhm", dimensions=["repetition"]))) as url:
        answer = post(url, {"query": STORIES, "labels": [human[0], {"reference": human[1]}, human[2], human[3]]}).json()
    assert answer["rewards"] == pytest.approx([0.0 if math.isnan(v) else v for v in want])
    assert answer["extra_logs"]["dhm/repetition"] == pytest.approx(expected(STORIES))
    assert answer["extra_logs"]["dhm/repetition/human"] == pytest.approx(expected(human))


def _hold_the_worker(url: str, spy: Spy) -> threading.Thread:
    """Send a request whose scoring waits for ``spy.gate``; returns once the
    worker is busy with it, so the next requests queue up."""
    thread = threading.Thread(target=lambda: post(url, {"query": ["WAIT here. WAIT there."]}))
    thread.start()
    _until(lambda: spy.calls)
    return thread


def _until(condition, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_requests_are_batched_each_answered_with_its_own_scores():
    spy = Spy()
    n_threads, per_request = 8, 3
    requests = [[story(t * per_request + k) for k in range(per_request)] for t in range(n_threads)]
    answers: dict[int, list[float]] = {}
    with run_in_thread(create_app(spy, max_batch_size=10, max_wait_ms=10)) as url:
        held = _hold_the_worker(url, spy)

        def client(t: int) -> None:
            r = post(url, {"query": requests[t], "prompts": [""] * per_request})
            assert r.status_code == 200, r.text
            answers[t] = r.json()["rewards"]

        threads = [threading.Thread(target=client, args=(t,)) for t in range(n_threads)]
        for thread in threads:
            thread.start()
        _until(lambda: httpx.get(f"{url}/info").json()["stats"]["requests"] == n_threads + 1)
        spy.gate.set()
        _join(*threads, held)
        info = httpx.get(f"{url}/info").json()
    assert sorted(answers) == list(range(n_threads))
    for t in range(n_threads):
        assert answers[t] == pytest.approx(expected(requests[t])), t
    # the 8 queued requests (24 stories) took 3 calls of whole requests within max_batch_size 10
    assert spy.calls == [1, 9, 9, 6]
    assert info["stats"]["reward_calls"] == 4 and info["batch_sizes"] == {"1": 1, "6": 1, "9": 2}


def test_requests_arriving_within_max_wait_share_a_call():
    spy = Spy()
    requests = [[story(t), story(t + 10)] for t in range(4)]
    # a full batch goes at once: max_batch_size is reached long before max_wait_ms
    with run_in_thread(create_app(spy, max_batch_size=8, max_wait_ms=10_000)) as url:
        barrier = threading.Barrier(4)
        results = {}
        start = time.monotonic()

        def client(t: int) -> None:
            barrier.wait()
            results[t] = post(url, {"query": requests[t]}).json()["rewards"]

        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        _join(*threads)
        elapsed = time.monotonic() - start
    assert spy.calls == [8]  # the first request waited for the others
    assert elapsed < 5
    assert all(results[t] == pytest.approx(expected(requests[t])) for t in range(4))


def test_a_request_larger_than_the_batch_is_scored_alone_and_whole():
    spy = Spy()
    stories = [story(i) for i in range(10)]
    with run_in_thread(create_app(spy, max_batch_size=4, max_wait_ms=0)) as url:
        assert post(url, {"query": stories}).json()["rewards"] == pytest.approx(expected(stories))
    assert spy.calls == [10]


BAD = [
    ("malformed JSON", b'{"query": ["a story.",', "malformed JSON"),
    ("not an object", [1, 2], "request body"),
    ("missing query", {"prompts": ["p"]}, "query: Field required"),
    ("query a string", {"query": "a story. two."}, "query: Input should be a valid array"),
    ("query of numbers", {"query": ["ok. ok.", 3]}, "query.1: Input should be a valid string"),
    ("prompts of numbers", {"query": ["a"], "prompts": [1]}, "prompts.0"),
    ("prompts too short", {"query": ["a", "b"], "prompts": ["p"]}, "prompts has 1 entries for 2 queries"),
    ("labels too long", {"query": ["a"], "labels": ["x", "y"]}, "labels has 2 entries for 1 queries"),
    ("label a number", {"query": ["a"], "labels": [5]}, "labels[0]: expected the human story"),
    ("label images a string", {"query": ["a"], "labels": [{"images": "x.png"}]}, "'images' must be a list"),
    ("label story_id a number", {"query": ["a"], "labels": [{"story_id": 1}]}, "'story_id' must be a string"),
]


def test_bad_requests_get_4xx_with_a_reason_and_the_server_keeps_serving():
    spy = Spy()
    with run_in_thread(create_app(spy)) as url:
        for name, body, reason in BAD:
            if isinstance(body, bytes):
                r = httpx.post(f"{url}/get_reward", content=body, headers={"content-type": "application/json"})
            else:
                r = post(url, body)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            detail = r.json()["detail"]
            assert isinstance(detail, str) and reason in detail, (name, detail)
        assert httpx.get(f"{url}/get_reward").status_code == 405
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES))
        assert httpx.get(f"{url}/info").json()["stats"]["bad_requests"] == len(BAD)
    assert spy.calls == [len(STORIES)]  # no bad request reached the reward


def test_a_failing_reward_gives_5xx_and_the_server_keeps_serving():
    spy = Spy()
    with run_in_thread(create_app(spy)) as url:
        spy.broken = True
        r = post(url, {"query": STORIES})
        assert r.status_code == 500 and "GPU on fire" in r.json()["detail"] and "repetition" in r.json()["detail"]
        spy.broken = False
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES))
        assert httpx.get(f"{url}/info").json()["stats"]["failed_requests"] == 1


def test_a_failing_request_does_not_fail_the_requests_batched_with_it():
    spy = Spy()
    clean = [[story(1), story(2)], [story(3)]]
    bodies = [{"query": ["POISON. POISON."]}, {"query": clean[0]}, {"query": clean[1]}]
    results: dict[int, httpx.Response] = {}
    with run_in_thread(create_app(spy, max_wait_ms=0)) as url:
        held = _hold_the_worker(url, spy)

        def client(i: int) -> None:
            results[i] = post(url, bodies[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        _until(lambda: httpx.get(f"{url}/info").json()["stats"]["requests"] == 4)
        spy.gate.set()
        _join(*threads, held)
    assert results[0].status_code == 500 and "poisoned batch" in results[0].json()["detail"]
    for i in (1, 2):
        assert results[i].status_code == 200
        assert results[i].json()["rewards"] == pytest.approx(expected(clean[i - 1]))
    # the three were one call, which failed; then one call each (in arrival order)
    assert spy.calls[:2] == [1, 4] and sorted(spy.calls[2:]) == [1, 1, 2]


# -- the command ---------------------------------------------------------------------------


def _one_error_line(result) -> str:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize(("text", "message"), [
    ("chunk_size: 4\n", "a reward config is a mapping with a 'reward: <name>' key"),
    ("reward: nope\n", "unknown reward 'nope'"),
    ("reward: repetition\nchunk_size: 0\n", "chunk_size"),
    ("reward: test_serve_unloadable\n", "checkpoint runs/missing not found"),
])
def test_serve_bad_config_is_a_one_line_error_before_listening(tmp_path, monkeypatch, text, message):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **k: pytest.fail("listened with a bad config"))
    config = tmp_path / "reward.yaml"
    config.write_text(text)
    line = _one_error_line(CliRunner().invoke(main, ["serve", "--config", str(config), "--port", "0"]))
    assert message in line


def test_serve_options_are_checked():
    result = CliRunner().invoke(main, ["serve", "--config", str(REPO / "configs/rewards/repetition.yaml"),
                                       "--max-batch-size", "0"])
    assert result.exit_code == 2 and "max-batch-size" in result.output
    assert CliRunner().invoke(main, ["serve", "--config", "missing.yaml"]).exit_code == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_storyrl_serve_command_end_to_end():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "STORYRL_REWARD_FALLBACK": "-3"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "storyrl.cli", "serve", "--config", str(REPO / "configs/rewards/repetition.yaml"),
         "--port", str(port), "--max-wait-ms", "5", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        answer = post(url, {"query": STORIES, "prompts": [""] * 4, "labels": [None] * 4}).json()
        assert answer["rewards"] == pytest.approx(expected(STORIES, fallback=-3.0))
        assert post(url, {"query": "x"}).status_code == 422
        assert post(url, {"query": STORIES[:2]}).json()["rewards"] == pytest.approx(expected(STORIES[:2]))
    finally:
        proc.terminate()
        proc.wait(10)


def test_help_does_not_import_the_server():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from storyrl.cli import main\n"
        "for args in (['--help'], ['serve', '--help']):\n"
        "    r = CliRunner().invoke(main, args)\n"
        "    assert r.exit_code == 0, r.output\n"
        "assert 'max-batch-size' in r.output\n"
        "loaded = [m for m in ('fastapi', 'uvicorn', 'starlette', 'pydantic', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_json_answers_never_hold_nan():
    # JSON has no NaN: unscorable stories get the fallback, components too.
    spy = Spy()
    with run_in_thread(create_app(spy, fallback=0.25)) as url:
        r = post(url, {"query": ["", "one.", STORIES[0]]})
    text = r.text
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["rewards"][:2] == [0.25, 0.25]
    assert np.isfinite(json.loads(text)["rewards"]).all()


def test_prompts_reach_a_group_normalised_reward():
    weighted = create_reward("weighted", components=[{"reward": "repetition", "weight": 1.0, "normalize": "group"}])
    stories = [STORIES[0], STORIES[1], STORIES[3], STORIES[1]]
    raw = create_reward("repetition").score(stories)
    want = [np.sign(raw[0] - raw[1]), np.sign(raw[1] - raw[0]), np.sign(raw[2] - raw[3]), np.sign(raw[3] - raw[2])]
    with run_in_thread(create_app(weighted)) as url:
        answer = post(url, {"query": stories, "prompts": ["P1", "P1", "P2", "P2"]}).json()
    assert answer["rewards"] == pytest.approx(want)


def test_a_group_normalised_reward_scores_each_request_alone():
    weighted = create_reward("weighted", components=[{"reward": "repetition", "weight": 1.0, "normalize": "group"}])
    first = {"query": [STORIES[0], STORIES[1]], "prompts": ["P", "P"]}
    second = {"query": [STORIES[3], STORIES[1], STORIES[0]], "prompts": ["P", "P", "P"]}
    # concurrent, same prompt: one batch and one group, unless requests are kept apart
    with run_in_thread(create_app(weighted, max_batch_size=64, max_wait_ms=500)) as url, ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda body: post(url, body).json(), [first, second]))
    for body, answer in zip([first, second], answers):
        raw = create_reward("repetition").score(body["query"])
        want = (raw - raw.mean()) / raw.std()  # the request's own group, and nobody else's
        assert answer["rewards"] == pytest.approx(list(want))


@pytest.mark.parametrize(("body", "says"), [
    ({"query": [STORIES[0]], "prompts": ["P"]}, "1 stories in 1 group"),
    ({"query": [STORIES[0], STORIES[1], STORIES[3]], "prompts": ["P", "P", "Q"]}, "some of one story"),
])
def test_a_group_normalised_reward_refuses_groups_of_one(body, says):
    weighted = create_reward("weighted", components=[{"reward": "repetition", "weight": 1.0, "normalize": "group"}])
    with run_in_thread(create_app(weighted)) as url:
        r = post(url, body)
    assert r.status_code == 422 and says in r.json()["detail"] and "group_norm" in r.json()["detail"]


def test_requests_without_the_human_story_name_the_label_flag():
    with run_in_thread(create_app(create_reward("rouge_l"))) as url:
        r = post(url, {"query": STORIES[:2], "labels": ["", ""]})
        assert r.status_code == 422 and "--data.label_key" in r.json()["detail"]
        ok = post(url, {"query": STORIES[:2], "labels": STORIES[1:3]})
    assert ok.json()["rewards"] == pytest.approx(list(create_reward("rouge_l").score(STORIES[:2],
                                                                                      reference=STORIES[1:3])))
