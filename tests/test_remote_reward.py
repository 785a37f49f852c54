"""``reward: remote``, the client of ``storyrl serve``: over real HTTP on the
loopback interface, its scores equal the served reward's local scores
(batched, chunked, with context and components); a fake misbehaving server
shows retries, backoff, timeouts, refused requests, malformed answers,
bounded concurrency and a server that stays down. Waits between retries go
through the reward's ``sleep`` hook, so nothing sleeps for long; every wait
on an answer is bounded (``WAIT_S``), so a server or batcher that waits far
too long fails a test instead of holding it."""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import pickle
import socket
import threading
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from storyrl.integrations.server import create_app, run_in_thread
from storyrl.rewards import build_reward, create_reward, load_reward_config
from storyrl.rewards import remote as remote_module
from storyrl.rewards.base import RewardError
from storyrl.rewards.remote import RemoteRewardError, RemoteRewardUnavailable

STORIES = [
    "The dog ran to the park. The dog ran to the lake. He was happy.",
    "We went to the beach. The sun was hot. We swam all day.",
    "one sentence only.",
    "A cat sat. A cat sat. A cat sat.",
    None,  # not text
    "Grandma turned ninety. The family came. She blew out the candles.",
    "",
]
#: The longest a test waits for one answer: far above a normal answer here (milliseconds), far
#: below what a server batcher reading its max_wait_ms (10 ms) as seconds would take.
WAIT_S = 5.0
REFERENCES = ["The dog ran to the park. It was fun.", "We went to the sea. It was hot.", "x", "A cat sat down.",
              "y", "Grandma was ninety. We all came.", "z"]


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float))


@pytest.fixture(scope="module")
def served():
    """storyrl serve with repetition, and with a weighted repetition + BLEU (context and components).
    Tests give its rewards retries=0: an answer slower than WAIT_S fails at once."""
    weighted = {"reward": "weighted", "components": [{"reward": "repetition", "weight": 1.0},
                                                     {"reward": "bleu", "weight": 0.5}]}
    with run_in_thread(create_app(create_reward("repetition"))) as rep_url, \
            run_in_thread(create_app(build_reward(weighted))) as weighted_url:
        yield {"repetition": rep_url, "weighted": weighted_url, "weighted_spec": weighted}


class Fake:
    """A misbehaving reward server: ``handler(body, attempt)`` answers each
    POST /get_reward and GET /health answers ``health_status``; records
    requests, headers and the most requests in flight at once."""

    def __init__(self):
        self.reset(None)

    def reset(self, handler):
        self.handler, self.bodies, self.headers = handler, [], []
        self.in_flight = self.max_in_flight = 0
        self.generation = getattr(self, "generation", 0) + 1  # a handler an earlier test left running counts not
        self.health_status = 200
        self.health_answer = None  # a function giving GET /health's response, when set

    async def health(self, request):
        if self.health_answer is not None:
            return self.health_answer()
        return JSONResponse({"status": "ok" if self.health_status == 200 else "no"}, status_code=self.health_status)

    async def get_reward(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        generation = self.generation
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.handler(body, len(self.bodies))
        finally:
            if generation == self.generation:
                self.in_flight -= 1


def words(body):
    """The fake's scores: words / 10 of each story (the query; no prompts sent)."""
    return JSONResponse({"rewards": [len(q.split()) / 10 for q in body["query"]],
                         "extra_logs": {"unscorable": [0.0] * len(body["query"])}})


@pytest.fixture(scope="module")
def fake_server():
    fake = Fake()
    app = Starlette(routes=[Route("/get_reward", fake.get_reward, methods=["POST"]),
                            Route("/health", fake.health)])
    with run_in_thread(app) as url:
        yield fake, url


@pytest.fixture
def fake(fake_server):
    server, url = fake_server
    server.reset(None)
    server.url = url
    return server


def remote(url, **options):
    """A remote reward whose retry waits are recorded, not slept; each
    request is bounded by WAIT_S unless the test sets timeout_s."""
    options.setdefault("timeout_s", WAIT_S)
    reward = create_reward("remote", url=url, **options)
    reward.waits = []

    async def sleep(seconds):
        reward.waits.append(seconds)

    reward.sleep = sleep
    return reward


def dead_url():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# -- equal to the local reward ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [64, 2, 1])
def test_scores_equal_the_local_reward_batched_and_chunked(served, chunk_size):
    reward = remote(served["repetition"], chunk_size=chunk_size, max_concurrency=2, retries=0)
    local = create_reward("repetition").score(STORIES)
    assert np.isnan(local).sum() == 3  # one sentence, None, "": unscorable, not the server's fallback 0.0
    same(reward.score(STORIES), local)
    texts = sum(isinstance(s, str) for s in STORIES)
    assert reward.http_stats["requests"] == math.ceil(texts / chunk_size)  # None is never sent
    assert reward.stats["reasons"] == {"not text": 1, "unscorable on the server": 2}
    assert reward.stats["scored"] == 4 and reward.stats["unscorable"] == 3


def test_context_and_components_equal_the_local_trl_call(served):
    """Per-story context (the human story) reaches the server; its extra_logs
    come back as the reward's log_extra columns, equal to the local ones."""
    local = build_reward(served["weighted_spec"])
    reward = remote(served["weighted"], chunk_size=3, retries=0)
    prompts = [[{"role": "user", "content": f"Tell story {k}."}] for k in range(len(STORIES))]
    completions = [[{"role": "assistant", "content": s}] if s is not None else None for s in STORIES]
    logged = {"local": ({}, {}), "remote": ({}, {})}

    def call(which, reward_fn):
        extra, metrics = logged[which]
        return reward_fn(prompts=prompts, completions=completions, reference=REFERENCES, story_id=list("abcdefg"),
                         log_extra=extra.__setitem__, log_metric=metrics.__setitem__, trainer_state=None)

    expected = call("local", local)
    got = asyncio.run(call("remote", reward))
    assert got == expected and sum(v is not None for v in got) == 4
    extra, local_extra = logged["remote"][0], logged["local"][0]
    components = {k: v for k, v in local_extra.items() if k != local.name}
    assert components and set(extra) == set(components)
    for column, values in components.items():
        # The server's fallback (0.0) where a component had no value; the story itself is None.
        assert [v for v, e in zip(extra[column], expected) if e is not None] == \
               [v for v, e in zip(values, expected) if e is not None], column
    assert logged["remote"][1]["remote/unscorable_frac"] == pytest.approx(3 / 7)
    # Other references give other BLEU scores: the context travelled.
    assert asyncio.run(reward(prompts=prompts, completions=completions, reference=REFERENCES[::-1])) != expected
    # None at all is the server's 422 (the reward needs them): raised at once, not a reward.
    with pytest.raises(RemoteRewardError, match="HTTP 422.*reference"):
        asyncio.run(reward(prompts=prompts, completions=completions))


def test_score_async_contract(served):
    reward = remote(served["weighted"], retries=0)
    contexts = [{"reference": r} for r in REFERENCES]
    scores, components = asyncio.run(reward.score_async(STORIES, contexts, ["p"] * len(STORIES)))
    local = build_reward(served["weighted_spec"])
    same(scores, local.score(STORIES, reference=REFERENCES))
    assert set(components) == {"weighted/repetition", "weighted/bleu"}
    assert all(v.shape == (len(STORIES),) for v in components.values())
    assert np.isnan(components["weighted/bleu"][4])  # not text: no answer at all
    with pytest.raises(ValueError, match="2 contexts for 7 stories"):
        asyncio.run(reward.score_async(STORIES, contexts[:2]))


def test_sync_score_works_inside_a_running_event_loop(served):
    """TRL's reward loop or verl's async manager may call the sync path."""
    reward = remote(served["repetition"], retries=0)

    async def inside():
        return reward.score(STORIES)

    same(asyncio.run(inside()), create_reward("repetition").score(STORIES))


def test_remote_from_yaml_as_a_weighted_component_and_in_storyrl_score(served, tmp_path):
    import json

    from click.testing import CliRunner

    from storyrl.cli import main

    config = tmp_path / "remote.yaml"
    config.write_text(f"reward: remote\nurl: {served['repetition']}/get_reward\nchunk_size: 2\n"
                      f"timeout_s: {WAIT_S}\nretries: 0\n")
    reward = load_reward_config(config)
    assert reward.endpoint == f"{served['repetition']}/get_reward" and reward.chunk_size == 2
    local = create_reward("repetition")
    same(reward.score(STORIES), local.score(STORIES))
    weighted = create_reward("weighted", components=[{"reward": str(config), "weight": 2.0}])
    same(weighted.score(STORIES), 2.0 * local.score(STORIES))

    stories = tmp_path / "stories.jsonl"
    stories.write_text("".join(json.dumps({"story_id": f"s{k}", "story": s}) + "\n"
                               for k, s in enumerate(STORIES[:4])))
    out = tmp_path / "scores.csv"
    result = CliRunner().invoke(main, ["score", str(stories), "--config", str(config), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    rows = out.read_text().splitlines()
    values = local.score(STORIES[:4])
    assert "remote" in rows[0] and len(rows) == 5
    for row, value in zip(rows[1:], values):
        cell = row.split(",")[-1]
        assert (cell in ("", "nan") if math.isnan(value) else float(cell) == pytest.approx(value))


def test_options_are_validated_never_coerced():
    with pytest.raises(TypeError, match="timeout_s"):
        create_reward("remote", url="http://h:1", timeout_s="5")
    with pytest.raises(ValueError, match="url must be an http"):
        create_reward("remote", url="h:1")
    with pytest.raises(ValueError, match="set max_consecutive_failures or down_after_s"):
        create_reward("remote", url="http://h:1", max_consecutive_failures=None)
    with pytest.raises(ValueError, match="max_backoff_s"):
        create_reward("remote", url="http://h:1", backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        create_reward("remote", url="http://h:1", chunk_size=0)
    assert create_reward("remote", url="http://h:1", label="judge").__name__ == "judge"


def test_pickles_before_and_after_use(served):
    reward = remote(served["repetition"], label="rep_remote", chunk_size=2, retries=0)
    fresh = pickle.loads(pickle.dumps(reward))
    first = reward.score(STORIES)
    used = pickle.loads(pickle.dumps(reward))
    for copy in (fresh, used):
        assert copy.__name__ == "rep_remote" and copy.transport is None
        same(copy.score(STORIES), first)
    assert used.stats["scored"] == 2 * reward.stats["scored"]  # counters travel, the client does not


def test_setup_checks_the_server(served):
    assert remote(served["repetition"], retries=0).setup() is not None
    with pytest.raises(RewardError, match="no reward server answers at .*/health"):
        remote(dead_url(), retries=0).setup()


@pytest.mark.parametrize("status", [404, 405])
def test_setup_accepts_a_server_without_health(fake, status):
    """A reward server other than storyrl serve may have no /health: it
    answered, so it is there."""
    fake.health_status = status
    assert remote(fake.url, retries=0).setup() is not None


def test_setup_raises_for_a_rejected_token(fake):
    fake.health_status = 401
    with pytest.raises(RemoteRewardError, match="HTTP 401.*check token"):
        remote(fake.url, retries=0).setup()


# -- a misbehaving server ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [500, 503, 429])
def test_retries_5xx_and_429_with_exponential_backoff_capped(fake, status):
    async def handler(body, attempt):
        return JSONResponse({"detail": "busy"}, status_code=status) if attempt <= 3 else words(body)

    fake.reset(handler)
    reward = remote(fake.url, retries=3, backoff_s=1.0, max_backoff_s=3.0)
    same(reward.score(["a b", "a b c"]), [0.2, 0.3])
    assert len(fake.bodies) == 4 and reward.waits == [1.0, 2.0, 3.0]
    assert reward.http_stats == {"requests": 4, "retries": 3}


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_honoured(fake, status):
    async def handler(body, attempt):
        return Response(status_code=status, headers={"Retry-After": "7"}) if attempt == 1 else words(body)

    fake.reset(handler)
    reward = remote(fake.url, backoff_s=0.5, max_backoff_s=10.0)
    same(reward.score(["a b"]), [0.2])
    assert reward.waits == [7.0]  # longer than the backoff, within max_backoff_s


@pytest.mark.parametrize("value, wait", [
    ("7", 3.0), ("1e9", 3.0), ("inf", 3.0), ("Infinity", 3.0), ("1e400", 3.0), ("9" * 5000, 3.0),
    ("Fri, 01 Jan 2099 00:00:00 GMT", 3.0), ("Sat, 01 Jan 9999 23:59:59 GMT", 3.0),
    ("nan", 0.5), ("-5", 0.0), ("soon", 0.5), ("Mon, 99 Foo 2099 00:00:00 GMT", 0.5),
])
def test_retry_after_is_capped_at_max_backoff_s(fake, value, wait):
    """A server asking for hours, for ever or a date in 2099 gets
    max_backoff_s; a header that is no wait (nan, garbage) the backoff."""
    async def handler(body, attempt):
        return Response(status_code=503, headers={"Retry-After": value}) if attempt == 1 else words(body)

    fake.reset(handler)
    reward = remote(fake.url, backoff_s=0.5, max_backoff_s=3.0)
    same(reward.score(["a b"]), [0.2])
    assert reward.waits == [wait]


def test_retry_after_as_an_http_date(fake):
    """An HTTP date ahead is a wait of that many seconds (within
    max_backoff_s); one in the past, none."""
    ahead = 20

    async def handler(body, attempt):
        if attempt > 2:
            return words(body)
        when = datetime.now(timezone.utc) + timedelta(seconds=ahead if attempt == 1 else -ahead)
        return Response(status_code=503, headers={"Retry-After": email.utils.format_datetime(when, usegmt=True)})

    fake.reset(handler)
    reward = remote(fake.url, backoff_s=0.5, max_backoff_s=30.0)
    same(reward.score(["a b"]), [0.2])
    (wait, past) = reward.waits
    assert ahead - 2 < wait <= ahead and past == 0.0  # the date has whole seconds


def test_retries_spent_give_nan_counted_not_a_reward(fake):
    async def handler(body, attempt):
        return JSONResponse({"detail": "boom"}, status_code=500)

    fake.reset(handler)
    reward = remote(fake.url, retries=2, backoff_s=0.1)
    same(reward.score(["a b", "c d e"]), [np.nan, np.nan])
    assert len(fake.bodies) == 3 and reward.stats["reasons"]["HTTP 500"] == 2
    assert reward.http_stats["failed"] == 1
    assert asyncio.run(reward(prompts=None, completions=["a b"])) == [None]
    # retries: 0 tries once
    reward = remote(fake.url, retries=0)
    fake.reset(handler)
    reward.score(["a"])
    assert len(fake.bodies) == 1 and reward.waits == []


@pytest.mark.parametrize("status, message", [(400, "bad labels"), (401, "check token"), (422, "bad labels")])
def test_other_4xx_raise_at_once_with_the_detail(fake, status, message):
    async def handler(body, attempt):
        return JSONResponse({"detail": "bad labels"}, status_code=status)

    fake.reset(handler)
    with pytest.raises(RemoteRewardError, match=f"HTTP {status}.*{message}"):
        remote(fake.url).score(["a b"])
    assert len(fake.bodies) == 1


def test_token_from_the_option_or_the_environment(fake, monkeypatch):
    async def handler(body, attempt):
        return words(body)

    fake.reset(handler)
    monkeypatch.setenv("STORYRL_SERVE_TOKEN", "from-env")
    remote(fake.url).score(["a"])
    remote(fake.url, token="secret").score(["a"])
    assert [h.get("authorization") for h in fake.headers] == ["Bearer from-env", "Bearer secret"]
    assert "secret" not in repr(remote(fake.url, token="secret"))
    monkeypatch.delenv("STORYRL_SERVE_TOKEN")
    remote(fake.url).score(["a"])
    assert "authorization" not in fake.headers[-1]


def test_timeout_gives_nan_and_is_counted(fake):
    async def handler(body, attempt):
        await asyncio.sleep(2.0)
        return words(body)

    fake.reset(handler)
    reward = remote(fake.url, timeout_s=0.2, retries=1)
    same(reward.score(["a b", "c"]), [np.nan, np.nan])
    assert reward.stats["reasons"]["timeout"] == 2 and len(fake.bodies) == 2


def _drip(body: bytes, every_s: float, most_s: float = 60.0):
    """An answer trickled one byte every ``every_s`` seconds after a run of
    spaces (JSON allows them) lasting ``most_s``: each byte comes well within
    any per-read timeout."""
    async def chunks():
        for _ in range(int(most_s / every_s)):
            yield b" "
            await asyncio.sleep(every_s)
        yield body

    return StreamingResponse(chunks(), media_type="application/json")


def test_a_trickled_answer_is_cut_at_timeout_s_and_the_server_counts_as_down(fake):
    """timeout_s bounds a request in all: a server trickling its answer (a
    byte every 0.1 s, for a minute) fails each request at timeout_s, so
    max_consecutive_failures stops the run within seconds."""
    async def handler(body, attempt):
        return _drip(json.dumps({"rewards": [0.9] * len(body["query"])}).encode(), every_s=0.1)

    fake.reset(handler)
    reward = remote(fake.url, timeout_s=0.5, retries=1, max_consecutive_failures=2)

    async def two_calls():
        scores, _ = await reward.score_async(["a b", "c"])
        with pytest.raises(RemoteRewardUnavailable, match="timeout.*within 0.5 s"):
            await reward.score_async(["a b"])
        return scores

    same(asyncio.run(asyncio.wait_for(two_calls(), 2 * WAIT_S)), [np.nan, np.nan])  # about 2 s (4 x 0.5 s)
    assert reward.stats["reasons"] == {"timeout": 3} and reward.http_stats["requests"] == 4


def test_a_trickled_health_answer_fails_setup_at_timeout_s(fake):
    fake.reset(None)
    fake.health_answer = lambda: _drip(b'{"status": "ok"}', every_s=0.1)
    reward = remote(fake.url, timeout_s=0.5, retries=0)
    raised = []

    def setup():
        try:
            reward.setup()
        except RewardError as exc:
            raised.append(exc)

    thread = threading.Thread(target=setup, daemon=True)  # a hanging setup fails the test, not the suite
    thread.start()
    thread.join(2 * WAIT_S)
    assert not thread.is_alive(), "setup still waits for the trickled answer"
    assert len(raised) == 1 and "timeout" in str(raised[0])


BIG = "1" + "0" * 400  # over a float's range: float() raises OverflowError
DEEP = "[" * 100_000 + "]" * 100_000  # over the JSON parser's recursion limit


@pytest.mark.parametrize("status, text, reason", [
    (200, f'{{"rewards": [{BIG}, 0.5]}}', "malformed answer"),
    (200, f'{{"scores": [0.5, -{BIG}]}}', "malformed answer"),
    (200, f'{{"rewards": [0.5, 0.5], "extra_logs": {{"unscorable": [{BIG}, 0]}}}}', "malformed answer"),
    (200, f'{{"rewards": [0.5, {"9" * 5000}]}}', "malformed answer"),  # over Python's 4300-digit limit
    (200, DEEP, "malformed answer"),
    (200, f'{{"rewards": [0.5, 0.5], "extra_logs": {DEEP}}}', "malformed answer"),
    (302, '{"rewards": [0.9, 0.9]}', "HTTP 302"),
    (307, '{"rewards": [0.9, 0.9]}', "HTTP 307"),
    (202, '{"rewards": [0.9, 0.9]}', "HTTP 202"),
    (203, '{"rewards": [0.9, 0.9]}', "HTTP 203"),
    (204, "", "HTTP 204"),
])
def test_every_malformed_or_non_200_answer_gives_nan_counted(fake, status, text, reason):
    """Only a 200 answer is a reward answer, and no answer crashes the
    client: numbers too large for a float, JSON nested too deep to parse, a
    redirect (not followed, even to a working endpoint) or an Accepted are
    NaN with the reason counted, never a reward, never an exception."""
    async def handler(body, attempt):
        headers = {"Location": f"{fake.url}/get_reward"} if 300 <= status < 400 else {}
        return Response(text if status != 204 else None, status_code=status, headers=headers,
                        media_type="application/json")

    fake.reset(handler)
    reward = remote(fake.url, retries=2)
    same(reward.score(["a b", "c"]), [np.nan, np.nan])
    assert reward.stats["reasons"] == {reason: 2} and len(fake.bodies) == 1  # not retried, not followed
    assert asyncio.run(reward(prompts=None, completions=["a b", "c"])) == [None, None]


def test_a_component_too_large_for_a_float_is_left_out_not_a_crash(fake):
    async def handler(body, attempt):
        return Response(f'{{"rewards": [0.5, 0.25], "extra_logs": {{"part": [{BIG}, 1], "ok": [1, 2]}}}}',
                        media_type="application/json")

    fake.reset(handler)
    reward = remote(fake.url)
    same(reward.score(["a b", "c"]), [0.5, 0.25])
    assert set(reward.last_components) == {"ok"}


@pytest.mark.parametrize("status", [500, 400])
def test_an_error_answer_nested_too_deep_is_named_by_its_status(fake, status):
    """The detail of a 5xx or 4xx answer is read safely too."""
    async def handler(body, attempt):
        return Response(DEEP, status_code=status, media_type="application/json")

    fake.reset(handler)
    reward = remote(fake.url, retries=0)
    if status == 500:
        same(reward.score(["a b"]), [np.nan])
        assert reward.stats["reasons"] == {"HTTP 500": 1}
    else:
        with pytest.raises(RemoteRewardError, match="HTTP 400"):
            reward.score(["a b"])


def test_setup_fails_for_a_redirect(fake):
    """A URL that redirects (say http to https, or a login page) is a wrong
    url: setup names the redirect instead of taking it for a server."""
    fake.reset(None)
    fake.health_answer = lambda: Response(status_code=302, headers={"Location": "https://elsewhere/login"})
    with pytest.raises(RewardError, match="HTTP 302.*https://elsewhere/login.*not followed"):
        remote(fake.url, retries=0).setup()


@pytest.mark.parametrize("answer, reason", [
    ({"rewards": [1.0]}, "wrong length"),
    ({"rewards": [1.0, "x"]}, "malformed answer"),
    ({"scores": None}, "malformed answer"),
    ({"rewards": [1.0, 2.0], "extra_logs": {"unscorable": [1]}}, "malformed answer"),
    ("not json", "malformed answer"),
])
def test_malformed_or_wrong_length_answers_give_nan(fake, answer, reason):
    async def handler(body, attempt):
        return Response("{oops") if answer == "not json" else JSONResponse(answer)

    fake.reset(handler)
    reward = remote(fake.url)
    same(reward.score(["a b", "c"]), [np.nan, np.nan])
    assert reward.stats["reasons"] == {reason: 2} and len(fake.bodies) == 1  # no retry: not transient


@pytest.mark.parametrize("key", ["rewards", "scores"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_rewards_are_a_malformed_answer(fake, key, value):
    """Python's JSON reads Infinity and NaN; neither may reach the trainer as
    a reward, and a server sending them is broken: the request's stories are
    NaN, counted as a malformed answer."""
    async def handler(body, attempt):
        return Response(f'{{"{key}": [0.5, {value}]}}', media_type="application/json")

    fake.reset(handler)
    reward = remote(fake.url)
    same(reward.score(["a b", "c"]), [np.nan, np.nan])
    assert reward.stats["reasons"] == {"malformed answer": 2}
    assert asyncio.run(reward(prompts=None, completions=["a b", "c"])) == [None, None]


def test_server_unscorable_flags_become_none(fake):
    async def handler(body, attempt):
        return JSONResponse({"rewards": [0.0, 5.0, 0.0], "extra_logs": {"unscorable": [1.0, 0.0, 1.0],
                                                                       "part": [0.0, 2.0, 1.0]}})

    fake.reset(handler)
    reward = remote(fake.url)
    extra = {}
    got = asyncio.run(reward(prompts=["p"] * 3, completions=["a", "b", "c"], log_extra=extra.__setitem__))
    assert got == [None, 5.0, None] and extra == {"part": [0.0, 2.0, 1.0]}
    assert reward.stats["reasons"] == {"unscorable on the server": 2}


@pytest.mark.parametrize("max_concurrency", [1, 3])
def test_requests_in_flight_are_bounded_and_chunks_overlap(fake, max_concurrency):
    full = asyncio.Event()

    async def handler(body, attempt):
        if fake.in_flight >= max_concurrency:
            full.set()
        try:  # hold each request until the bound is reached (at most 2 s)
            await asyncio.wait_for(full.wait(), 2.0)
        except asyncio.TimeoutError:
            pass
        return words(body)

    fake.reset(handler)
    stories = [" ".join(["w"] * k) for k in range(1, 13)]
    reward = remote(fake.url, chunk_size=2, max_concurrency=max_concurrency)
    same(reward.score(stories), [k / 10 for k in range(1, 13)])
    assert len(fake.bodies) == 6 and all(len(b["query"]) == 2 for b in fake.bodies)
    assert fake.max_in_flight == max_concurrency


def test_the_bound_holds_without_httpx_connection_limit():
    """A transport of its own (here the test hook) has no connection pool:
    max_concurrency alone bounds the requests in flight."""
    import httpx

    in_flight, most = [0], [0]

    async def handler(request):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        return httpx.Response(200, json={"rewards": [1.0]})

    reward = remote("http://reward-server:5000", max_concurrency=1, chunk_size=1)
    reward.transport = httpx.MockTransport(handler)
    same(reward.score(["a", "b", "c"]), [1.0, 1.0, 1.0])
    assert most[0] == 1 and reward.http_stats == {"requests": 3}


def test_queued_requests_do_not_spend_their_timeout_waiting_for_a_connection(fake):
    """Requests wait for their turn before their timeout starts: each answer
    takes over half the timeout, so a third request waiting from the start
    would time out. (httpcore 1.0 happens to restart its own pool wait at
    each free connection, so this holds without the semaphore too.)"""
    async def handler(body, attempt):
        await asyncio.sleep(0.9)
        return words(body)

    fake.reset(handler)
    reward = remote(fake.url, timeout_s=1.5, max_concurrency=1, chunk_size=1)
    same(reward.score(["a", "a b", "a b c"]), [0.1, 0.2, 0.3])
    assert reward.http_stats == {"requests": 3} and reward.waits == [] and not reward.stats["reasons"]


def test_a_server_that_stays_down_stops_the_run(fake):
    url = dead_url()
    reward = remote(url, retries=1, max_consecutive_failures=2)
    same(reward.score(["a b"]), [np.nan])  # the first failing call: NaN, counted
    assert reward.stats["reasons"]["connection error"] == 1
    with pytest.raises(RemoteRewardUnavailable) as caught:
        reward.score(["a b"])
    message = str(caught.value)
    assert "\n" not in message and f"{url}/get_reward" in message and "connection error" in message
    assert "storyrl serve" in message and "2 call(s) in a row" in message
    with pytest.raises(RemoteRewardUnavailable):  # it stays an error while the server is down
        asyncio.run(reward(prompts=None, completions=["a b"]))


def test_a_call_that_succeeds_resets_the_count(fake):
    async def handler(body, attempt):
        return words(body) if attempt % 2 == 0 else JSONResponse({}, status_code=500)

    fake.reset(handler)
    reward = remote(fake.url, retries=0, max_consecutive_failures=2)
    results = [reward.score(["a b"])[0] for _ in range(6)]  # fail, ok, fail, ok, ...
    same(results, [np.nan, 0.2] * 3)


def test_down_after_seconds(fake, monkeypatch):
    from storyrl.rewards import remote as remote_module

    now = [100.0]
    monkeypatch.setattr(remote_module, "_clock", lambda: now[0])
    reward = remote(dead_url(), retries=0, max_consecutive_failures=None, down_after_s=30.0)
    for _ in range(5):  # many failures, but not for 30 s yet
        same(reward.score(["a"]), [np.nan])
    now[0] += 30.0
    with pytest.raises(RemoteRewardUnavailable, match="for 30 s"):
        reward.score(["a"])


def test_a_call_that_succeeds_restarts_the_down_clock(fake, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(remote_module, "_clock", lambda: now[0])

    async def handler(body, attempt):
        return words(body) if attempt == 2 else JSONResponse({}, status_code=500)

    fake.reset(handler)
    reward = remote(fake.url, retries=0, max_consecutive_failures=None, down_after_s=30.0)
    same(reward.score(["a"]), [np.nan])
    same(reward.score(["a b"]), [0.2])
    now[0] += 31.0
    same(reward.score(["a"]), [np.nan])  # failing since this call, not since the first


def test_the_down_clock_starts_with_the_first_failing_call(fake, monkeypatch):
    """Each call takes 6 s: the second ends 12 s after the first started."""
    now = [100.0]
    monkeypatch.setattr(remote_module, "_clock", lambda: now[0])

    async def handler(body, attempt):
        now[0] += 6.0
        return JSONResponse({}, status_code=500)

    fake.reset(handler)
    reward = remote(fake.url, retries=0, max_consecutive_failures=None, down_after_s=10.0)
    same(reward.score(["a"]), [np.nan])
    with pytest.raises(RemoteRewardUnavailable, match="for 12 s"):
        reward.score(["a"])


def test_a_call_with_some_failed_requests_is_no_failed_call(fake, monkeypatch):
    """The server is down only when every request of a call failed; a call
    with one failing request among others gives NaN for its stories only."""
    now = [100.0]
    monkeypatch.setattr(remote_module, "_clock", lambda: now[0])

    async def handler(body, attempt):
        return JSONResponse({}, status_code=500) if body["query"] == ["bad"] else words(body)

    fake.reset(handler)
    reward = remote(fake.url, retries=0, chunk_size=1, max_consecutive_failures=2, down_after_s=10.0)
    for _ in range(4):
        same(reward.score(["a b", "bad", "a b c"]), [0.2, np.nan, 0.3])
        now[0] += 20.0
    assert reward.stats["reasons"] == {"HTTP 500": 4}


def test_concurrent_calls_share_the_bound(fake):
    """verl's async manager scores one story per call, many at once."""
    async def handler(body, attempt):
        await asyncio.sleep(0.05)
        return words(body)

    fake.reset(handler)
    reward = remote(fake.url, max_concurrency=2)

    async def many():
        return await asyncio.gather(*(reward.score_async([" ".join(["w"] * k)]) for k in range(1, 9)))

    results = asyncio.run(many())
    assert [float(s[0]) for s, _ in results] == [k / 10 for k in range(1, 9)]
    assert fake.max_in_flight <= 2 and len(fake.bodies) == 8


def test_calls_from_several_threads(served):
    reward = remote(served["repetition"], chunk_size=1, retries=0)
    local = create_reward("repetition").score(STORIES)
    out = [None] * 4

    def work(k):
        out[k] = reward.score(STORIES)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * WAIT_S)
        assert not t.is_alive()
    for scores in out:
        same(scores, local)


def test_send_context_and_image_root_shape_the_labels(fake, tmp_path):
    async def handler(body, attempt):
        return words(body)

    fake.reset(handler)
    root = tmp_path / "images"
    context = {"reference": ["the human story"], "story_id": ["s0"], "noun_phrases": [["a dog"]],
               "images": [[str(root / "a" / "1.jpg"), "2.jpg", "/elsewhere/3.jpg"]],
               "story_images": [[str(root / "4.jpg")]]}
    remote(fake.url).score(["a b"], **context)
    remote(fake.url, send_context=["reference", "images"], image_root=str(root)).score(["a b"], **context)
    remote(fake.url, send_context=[]).score(["a b"], **context)
    labels = [body["labels"][0] for body in fake.bodies]
    # story_images take the place of images (as for local rewards); paths under image_root travel relative
    assert labels[0] == {"reference": "the human story", "story_id": "s0", "noun_phrases": ["a dog"],
                         "images": [str(root / "4.jpg")]}
    assert labels[1] == {"reference": "the human story", "images": ["4.jpg"]}
    assert labels[2] is None
    del context["story_images"]
    remote(fake.url, send_context=["images"], image_root=str(root)).score(["a b"], **context)
    assert fake.bodies[-1]["labels"][0] == {"images": ["a/1.jpg", "2.jpg", "/elsewhere/3.jpg"]}
    with pytest.raises(ValueError, match="send_context: unknown key 'story_images'"):
        create_reward("remote", url="http://h:1", send_context=["story_images"])


def test_prompts_travel_with_the_story_and_are_cut_off_by_the_server(served):
    """A prompt that also occurs inside the story does not cut the story short."""
    story = "Tell me a story. The dog ran. The dog ran to the lake. Tell me a story."
    reward = remote(served["repetition"], retries=0)
    got = asyncio.run(reward(prompts=["Tell me a story."], completions=[story]))
    assert got == [create_reward("repetition").score([story])[0]]


def test_a_prompt_group_stays_in_one_request(fake):
    """A group-normalised served reward must see whole groups: requests of up
    to chunk_size stories, split between prompts only."""
    async def handler(body, attempt):
        return words(body)  # the query is prompt + story: "p1" + "w w" counts 2 words

    fake.reset(handler)
    prompts = ["p1"] * 3 + ["p2"] * 3 + ["p3"] * 2 + [None, None]
    stories = [" ".join(["w"] * k) for k in range(1, 11)]
    got = asyncio.run(remote(fake.url, chunk_size=4)(prompts=prompts, completions=stories))
    assert got == pytest.approx([k / 10 for k in range(1, 11)])
    sent = sorted((b["prompts"] for b in fake.bodies), key=str)
    assert sent == sorted([["p1"] * 3, ["p2"] * 3, ["p3", "p3", None, None]], key=str)
    # A group over chunk_size is split; story_id tells groups of one prompt apart.
    fake.reset(handler)
    asyncio.run(remote(fake.url, chunk_size=2)(prompts=["p"] * 6, completions=stories[:6],
                                                  story_id=["a", "b", "a", "b", "b", "b"]))
    sent = sorted(([label["story_id"] for label in b["labels"]] for b in fake.bodies), key=str)
    assert sent == [["a", "a"], ["b", "b"], ["b", "b"]]


def test_a_story_too_long_for_the_server_costs_its_own_reward_only():
    from storyrl.integrations.serve_guards import Limits

    stories = [STORIES[0], "A long story. " * 10, STORIES[1]]
    local = create_reward("repetition").score(stories)
    with run_in_thread(create_app(create_reward("repetition"), limits=Limits(max_story_chars=100))) as url:
        reward = remote(url, max_story_chars=100, retries=0)
        got = reward.score(stories)
        assert np.isnan(got[1]) and got[[0, 2]] == pytest.approx(local[[0, 2]])
        assert reward.stats["reasons"]["longer than max_story_chars"] == 1
        # not checked here: the server refuses the whole request, a configuration error that stops the run
        with pytest.raises(RemoteRewardError, match="max-story-chars"):
            remote(url, max_story_chars=None).score(stories)
