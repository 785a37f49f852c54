"""``storyrl serve`` under bad and heavy input: limits (body, stories,
characters, time per call), parsing off the event loop, clients that go
away, shutdown with a request in flight, the image root and pixel limit,
token authentication, answers that depend on the request only, option
validation, the bounded d_HM cache and the load benchmark."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import REPO
from PIL import Image
from test_serve import STORIES, WAIT_S, Spy, _hold_the_worker, _join, _until, expected, post, story

import storyrl.integrations.server as server_module
from storyrl.cli import main
from storyrl.integrations import strip_end_markers
from storyrl.integrations.batching import RequestBatcher
from storyrl.integrations.openrlhf import END_MARKERS, story_from_query
from storyrl.integrations.server import Limits, create_app, run_in_thread
from storyrl.rewards import create_reward


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("STORYRL_REWARD_FALLBACK", raising=False)
    monkeypatch.delenv("STORYRL_SERVE_TOKEN", raising=False)


class Recorder(Spy):
    """Spy that records the stories and image contexts it scores, and whose
    scoring raises for every story holding "BAD" (isolated per story by the
    base class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stories: list[str] = []
        self.images: list = []

    def score(self, stories, **context):
        self.stories.extend(stories)
        self.images.extend(context.get("images") or [])
        return super().score(stories, **context)

    def _score_batch(self, stories, **context):
        if any("BAD" in s for s in stories):
            raise ValueError("cannot score BAD")
        return super()._score_batch(stories, **context)


def info(url: str, **kwargs) -> dict:
    return httpx.get(f"{url}/info", **kwargs).json()


# -- limits ---------------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_naming_it_also_when_chunked():
    spy = Spy()
    with run_in_thread(create_app(spy, limits=Limits(max_body_bytes=1000))) as url:
        r = post(url, {"query": ["A long story. " * 100]})  # Content-Length says it
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"] and "1000" in r.json()["detail"]
        chunks = (b'{"query": ["' + b"x" * 100 for _ in range(50))  # no Content-Length: chunked
        r = httpx.post(f"{url}/get_reward", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"]
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES))
    assert spy.calls == [len(STORIES)]


def test_too_many_stories_or_too_long_a_story_is_a_422_naming_the_limit():
    spy = Spy()
    limits = Limits(max_stories_per_request=3, max_story_chars=100)
    with run_in_thread(create_app(spy, limits=limits)) as url:
        r = post(url, {"query": STORIES})
        assert r.status_code == 422 and "4 stories" in r.json()["detail"]
        assert "--max-stories-per-request" in r.json()["detail"]
        r = post(url, {"query": ["short. story.", "x. " * 60]})
        assert r.status_code == 422 and "query[1]" in r.json()["detail"] and "--max-story-chars" in r.json()["detail"]
        # the prompt is not the story: a long prompt is fine
        prompt = "[INST] " + "Tell a story about the sea. " * 20 + "[/INST]"
        r = post(url, {"query": [prompt + STORIES[0]], "prompts": [prompt]})
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected(STORIES[:1]))
    assert spy.calls == [1]


def test_a_query_of_500000_end_markers_is_refused_at_once_and_health_answers():
    with run_in_thread(create_app(Spy())) as url:
        r = post(url, {"query": ["Once upon a time." + "</s>" * 500_000]})
        assert r.status_code == 422 and "--max-story-chars" in r.json()["detail"]
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}


def test_parsing_runs_off_the_event_loop(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = server_module.split_queries

    def slow_split(*args):
        entered.set()
        assert release.wait(20)
        return real(*args)

    monkeypatch.setattr(server_module, "split_queries", slow_split)
    results = {}
    with run_in_thread(create_app(Spy())) as url:
        client = threading.Thread(target=lambda: results.setdefault("r", post(url, {"query": STORIES})))
        client.start()
        assert entered.wait(20)
        # the loop is free while a request is being parsed
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        release.set()
        _join(client)
    assert results["r"].json()["rewards"] == pytest.approx(expected(STORIES))


@pytest.mark.parametrize("query", [
    "Once upon a time.</s></s>",
    "  a story <|im_end|>\n <|endoftext|>  </s>\n",
    "no marker at all",
    "</s>",
    "  ",
    "ends in marker text</s>x",
    "story" + "</s> " * 1000,
    "<pad><pad>[PAD] a b [SEP]<eos>",
])
def test_strip_end_markers_equals_story_from_query(query):
    assert strip_end_markers(query, END_MARKERS) == story_from_query(query, None)


def test_strip_end_markers_is_linear():
    # the quadratic loop took minutes on this; one pass takes milliseconds
    assert strip_end_markers("A story." + "</s>" * 500_000, END_MARKERS) == "A story."
    assert strip_end_markers("x" + " <pad>\n" * 200_000, ["<pad>", ""]) == "x"


def test_a_reward_call_past_the_time_limit_answers_504_then_503_until_it_returns():
    spy = Spy()
    with run_in_thread(create_app(spy, timeout_s=0.2)) as url:
        r = post(url, {"query": ["WAIT here. WAIT there."]})
        assert r.status_code == 504 and "0.2 s" in r.json()["detail"] and "--timeout-s" in r.json()["detail"]
        # the call still runs in the worker thread: refused at once, and /health says so
        assert httpx.get(f"{url}/health").status_code == 503
        r = post(url, {"query": STORIES})
        assert r.status_code == 503 and "busy" in r.json()["detail"]
        spy.gate.set()
        _until(lambda: httpx.get(f"{url}/health").status_code == 200)
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES))
        assert info(url)["stats"]["timed_out_calls"] == 1
    assert spy.calls == [1, len(STORIES)]


# -- clients that went away ------------------------------------------------------------------


def _abandoned_request(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_requests_of_clients_that_disconnected_are_not_scored():
    spy = Recorder()
    gone = [f"GONE {i} went. It was gone." for i in range(3)]
    with run_in_thread(create_app(spy, max_wait_ms=0)) as url:
        held = _hold_the_worker(url, spy)
        sockets = [_abandoned_request(url, {"query": [text]}) for text in gone]
        _until(lambda: info(url)["stats"]["requests"] == 4)
        for sock in sockets:
            sock.close()
        _until(lambda: info(url)["stats"].get("disconnected") == 3)
        spy.gate.set()
        _join(held)
        assert post(url, {"query": STORIES}).json()["rewards"] == pytest.approx(expected(STORIES))
        assert info(url)["stats"]["dropped_requests"] == 3
    assert not any(s.startswith("GONE") for s in spy.stories), spy.stories
    assert spy.calls == [1, len(STORIES)]


# -- shutdown --------------------------------------------------------------------------------

_BLOCKING_SERVER = """
import sys, threading
from storyrl.cli import main
from storyrl.rewards import Reward, register_reward

@register_reward()
class Stuck(Reward):
    name = "test_stuck"

    def _score_batch(self, stories, **context):
        threading.Event().wait()  # never returns

main(sys.argv[1:], prog_name="storyrl")
"""


@contextlib.contextmanager
def _served_in_a_process(tmp_path, script_text: str, reward: str, shutdown_timeout_s: float):
    """``storyrl serve`` of ``reward`` (registered by ``script_text``) in its
    own process, healthy; yields (process, url, log file); killed if alive
    at the end."""
    script, config, log = tmp_path / "serve.py", tmp_path / "reward.yaml", tmp_path / "log.txt"
    script.write_text(script_text)
    config.write_text(f"reward: {reward}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), "serve", "--config", str(config), "--port", str(port),
                                 "--shutdown-timeout-s", str(shutdown_timeout_s), "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _until(lambda: proc.poll() is not None or _healthy(url), timeout=60)
        assert proc.poll() is None, log.read_text()
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _in_flight(url: str, body: dict) -> tuple[dict, threading.Thread]:
    """Post ``body`` from a thread and return once the server holds it:
    ({"r": response} when answered, the thread)."""
    answer = {}
    client = threading.Thread(target=lambda: answer.setdefault("r", post(url, body)))
    client.start()
    _until(lambda: info(url)["stats"].get("requests") == 1)
    return answer, client


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_with_a_request_in_flight_stops_the_server_within_the_bound(tmp_path, sig):
    with _served_in_a_process(tmp_path, _BLOCKING_SERVER, "test_stuck", 1) as (proc, url, log):
        answer, client = _in_flight(url, {"query": STORIES})
        start = time.monotonic()
        proc.send_signal(sig)
        proc.wait(20)  # the bound is 1 s + 2 s; generous here
        _join(client)
        assert time.monotonic() - start < 20
    assert answer["r"].status_code == 503 and "shutting down" in answer["r"].json()["detail"], log.read_text()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


# -- images ----------------------------------------------------------------------------------


@pytest.fixture
def image_dirs(tmp_path):
    root, outside = tmp_path / "images", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (10, 10)).save(root / "a.png")
    Image.new("RGB", (8, 8)).save(root / "sub" / "b.png")
    Image.new("RGB", (200, 100)).save(root / "big.png")
    Image.new("RGB", (4, 4)).save(outside / "secret.png")
    os.symlink(outside / "secret.png", root / "link.png")
    return root, outside


def test_without_an_image_root_requests_naming_images_are_refused():
    spy = Spy()
    with run_in_thread(create_app(spy)) as url:
        for label in ({"images": ["a.png"]}, {"story_images": ["/etc/passwd"]}, {"image_ids": ["../../etc/hostname"]}):
            r = post(url, {"query": STORIES[:2], "labels": [None, label]})
            assert r.status_code == 422 and "labels[1]" in r.json()["detail"], r.text
            assert "--image-root" in r.json()["detail"]
    assert spy.calls == []


def test_images_resolve_inside_the_image_root_only(image_dirs):
    root, _ = image_dirs
    spy = Recorder()
    with run_in_thread(create_app(spy, limits=Limits(image_root=str(root)))) as url:
        bad = [("/etc/passwd", "relative"), ("/dev/zero", "relative"), ("../outside/secret.png", "outside"),
               ("sub/../../outside/secret.png", "outside"), ("link.png", "outside")]
        for path, reason in bad:
            r = post(url, {"query": STORIES[:2], "labels": [None, {"story_images": ["a.png", path]}]})
            assert r.status_code == 422, (path, r.text)
            assert "labels[1]" in r.json()["detail"] and reason in r.json()["detail"], (path, r.text)
        r = post(url, {"query": STORIES[:1], "labels": [{"image_ids": ["../../etc/hostname"]}]})
        assert r.status_code == 422 and "outside" in r.json()["detail"]
        r = post(url, {"query": STORIES[:2], "labels": [{"images": ["a.png", "sub/b.png"]}, {"image_ids": ["a"]}]})
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected(STORIES[:2]))
    real = os.path.realpath(root)
    assert spy.images == [[f"{real}/a.png", f"{real}/sub/b.png"], None]  # absolute, inside the root


def test_an_image_over_the_pixel_limit_makes_its_story_unscorable_undecoded(image_dirs, monkeypatch):
    root, _ = image_dirs
    spy = Recorder()
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self) or pytest.fail("decoded"))
    limits = Limits(image_root=str(root), max_image_pixels=10_000)  # big.png has 20,000
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        labels = [{"images": ["a.png"]}, {"images": ["sub/b.png", "big.png"]}, {"images": ["a.png"]}]
        r = post(url, {"query": STORIES[:3], "labels": labels})
        assert r.status_code == 200
        assert r.json()["rewards"] == pytest.approx([*expected(STORIES[:1]), -1.0, -1.0])  # STORIES[2]: 1 sentence
        assert r.json()["extra_logs"]["unscorable"] == [0.0, 1.0, 1.0]
        assert info(url)["stats"]["unscorable_images"] == 1
    assert spy.stories == [STORIES[0], STORIES[2]]  # the story with the big image never reached the reward
    assert not decoded


# -- authentication --------------------------------------------------------------------------


def test_a_token_guards_every_endpoint_but_health():
    spy = Spy()
    with run_in_thread(create_app(spy, token="s3cret")) as url:
        good = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = post(url, {"query": STORIES}, headers=headers)
            assert r.status_code == 401 and "token" in r.json()["detail"]
            assert httpx.get(f"{url}/info", headers=headers).status_code == 401
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert post(url, {"query": STORIES}, headers=good).json()["rewards"] == pytest.approx(expected(STORIES))
        assert info(url, headers=good)["config"] == {"chunk_size": 4}
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{url}{path}", headers=good).status_code == 404
    assert spy.calls == [len(STORIES)]


def test_docs_only_when_asked_and_no_config_in_info_without_a_token():
    with run_in_thread(create_app(Spy(), docs=True)) as url:
        assert httpx.get(f"{url}/openapi.json").status_code == 200
        assert httpx.get(f"{url}/docs").status_code == 200
        assert "config" not in info(url)
    with run_in_thread(create_app(Spy())) as url:
        assert httpx.get(f"{url}/openapi.json").status_code == 404


def _invoke(args, env=None):
    return CliRunner().invoke(main, ["serve", "--config", str(REPO / "configs/rewards/repetition.yaml"), *args],
                              env=env)


def test_serve_warns_beyond_loopback_without_a_token(monkeypatch):
    served = []
    monkeypatch.setattr(server_module, "serve", lambda app, **kw: served.append((app, kw)))
    result = _invoke(["--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.output and "STORYRL_SERVE_TOKEN" in result.output
    for args, env in ((["--host", "0.0.0.0", "--token", "t"], None), (["--host", "0.0.0.0"],
                                                                      {"STORYRL_SERVE_TOKEN": "t"}),
                      (["--host", "127.0.0.1"], None), (["--host", "::1"], None)):
        result = _invoke(args, env)
        assert result.exit_code == 0 and "WARNING" not in result.output, (args, result.output)
    assert len(served) == 5 and served[-1][1]["host"] == "::1"
    assert _invoke(["--token", " "]).exit_code != 0


# -- one request's answer depends on that request only ----------------------------------------


def test_an_all_failing_request_gets_the_same_500_alone_and_batched():
    spy = Recorder()
    failing = ["BAD one. BAD two.", "BAD three. BAD four."]
    clean = [story(1), story(2)]
    with run_in_thread(create_app(spy, max_wait_ms=0)) as url:
        held = _hold_the_worker(url, spy)
        results = {}
        threads = [threading.Thread(target=lambda i=i, q=q: results.setdefault(i, post(url, {"query": q})))
                   for i, q in enumerate((failing, clean))]
        for thread in threads:
            thread.start()
        _until(lambda: info(url)["stats"]["requests"] == 3)
        spy.gate.set()
        _join(*threads, held)
        alone = post(url, {"query": failing})
    assert alone.status_code == 500 and "cannot score BAD" in alone.json()["detail"]
    assert results[0].status_code == 500 and results[0].json()["detail"] == alone.json()["detail"]
    assert results[1].status_code == 200 and results[1].json()["rewards"] == pytest.approx(expected(clean))
    assert spy.calls == [1, 4, 2, 2]  # held; the shared call, then the failing request alone; alone again


def test_unscorable_stories_get_the_fallback_alone_and_batched():
    spy = Spy()
    unscorable = ["one sentence.", "another one."]
    with run_in_thread(create_app(spy, max_wait_ms=0)) as url:
        held = _hold_the_worker(url, spy)
        results = {}
        threads = [threading.Thread(target=lambda i=i, q=q: results.setdefault(i, post(url, {"query": q}).json()))
                   for i, q in enumerate((unscorable, STORIES[:2]))]
        for thread in threads:
            thread.start()
        _until(lambda: info(url)["stats"]["requests"] == 3)
        spy.gate.set()
        _join(*threads, held)
        alone = post(url, {"query": unscorable}).json()
    assert spy.calls[:2] == [1, 4]  # held, then the two requests in one call
    assert alone == results[0] == {"rewards": [0.0, 0.0], "scores": [0.0, 0.0],
                                   "extra_logs": {"unscorable": [1.0, 1.0]}}
    assert results[1]["rewards"] == pytest.approx(expected(STORIES[:2]))


def test_failures_of_earlier_requests_do_not_fail_a_later_one():
    # the reward's "16 stories failing in a row" guard counts per call, not across clients
    spy = Recorder()
    with run_in_thread(create_app(spy)) as url:
        assert post(url, {"query": STORIES[:1]}).status_code == 200
        answers = [post(url, {"query": [f"BAD {i}. BAD again."]}) for i in range(20)]
    assert [a.status_code for a in answers] == [200] * 20
    assert all(a.json()["extra_logs"]["unscorable"] == [1.0] for a in answers)


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--max-wait-ms", "inf"], "inf is not in the range"),
    (["--max-wait-ms", "nan"], "not a finite number"),
    (["--max-wait-ms", "-1"], "max-wait-ms"),
    (["--timeout-s", "0"], "timeout-s"),
    (["--timeout-s", "nan"], "not a finite number"),
    (["--shutdown-timeout-s", "inf"], "shutdown-timeout-s"),
    (["--max-body-bytes", "0"], "max-body-bytes"),
    (["--max-stories-per-request", "0"], "max-stories-per-request"),
    (["--max-story-chars", "0"], "max-story-chars"),
    (["--max-image-pixels", "0"], "max-image-pixels"),
    (["--image-root", "no/such/dir"], "image-root"),
    (["--fallback", "nan"], "not a finite number"),
    (["--receive-timeout-s", "0"], "receive-timeout-s"),
    (["--receive-timeout-s", "inf"], "receive-timeout-s"),
    (["--receive-timeout-s", "nan"], "not a finite number"),
    (["--max-connections", "0"], "max-connections"),
])
def test_serve_refuses_bad_options(monkeypatch, args, message):
    monkeypatch.setattr(server_module, "serve", lambda *a, **k: pytest.fail("served with a bad option"))
    result = _invoke(args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("kwargs", [{"max_wait_ms": math.inf}, {"max_wait_ms": math.nan}, {"max_wait_ms": -1},
                                    {"timeout_s": math.inf}, {"timeout_s": 0}, {"max_batch_size": 0}])
def test_the_library_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RequestBatcher(lambda *a: None, **kwargs)
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        create_app(Spy(), **kwargs)


@pytest.mark.parametrize("kwargs", [{"max_body_bytes": 0}, {"max_story_chars": 1.5}, {"image_root": "no/such/dir"},
                                    {"receive_timeout_s": 0}, {"receive_timeout_s": math.inf},
                                    {"receive_timeout_s": math.nan}, {"receive_timeout_s": "5"},
                                    {"max_connections": 0}, {"max_connections": 2.0}, {"max_connections": True}])
def test_limits_are_checked(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Limits(**kwargs)


# -- the d_HM human-score cache ----------------------------------------------------------------


def test_the_dhm_human_cache_is_bounded_and_scores_stay_equal():
    refs = [f"Ref {i} went out. Ref {i} came back. It was day {i}." for i in range(10)]
    stories = [story(i) for i in range(10)]
    want = create_reward("dhm", dimensions=["repetition"]).score(stories, reference=refs)
    dhm = create_reward("dhm", dimensions=["repetition"], human_cache_size=3)
    for _ in range(3):  # three epochs, two stories per call
        got = np.concatenate([dhm.score(stories[j:j + 2], reference=refs[j:j + 2]) for j in range(0, 10, 2)])
        np.testing.assert_allclose(got, want)
        assert len(dhm.human_cache) <= 3
    assert dhm.stats["human_scored"] == 30  # 10 references, 3 kept: rescored every epoch
    dhm.score(stories[:1], reference=refs[9:10])  # recently used: still cached
    assert dhm.stats["human_scored"] == 30
    assert create_reward("dhm", dimensions=["repetition"]).human_cache_size == 50_000


def test_the_dhm_human_cache_keeps_the_recently_used_and_exactly_its_size():
    refs = [f"Ref {i} went out. Ref {i} came back. It was day {i}." for i in range(6)]
    dhm = create_reward("dhm", dimensions=["repetition"], human_cache_size=3)
    dhm.score([story(i) for i in range(3)], reference=refs[:3])  # A B C
    assert [ref for _, ref in dhm.human_cache] == refs[:3]
    dhm.score([story(0)], reference=refs[:1])  # A used: a hit
    assert dhm.stats["human_scored"] == 3
    dhm.score([story(3)], reference=refs[3:4])  # D: the least recently used, B, goes
    assert [ref for _, ref in dhm.human_cache] == [refs[2], refs[0], refs[3]]
    dhm.score([story(0)], reference=refs[:1])  # A still cached
    assert dhm.stats["human_scored"] == 4
    dhm.score([story(4), story(5)], reference=refs[4:6])  # over the size by two at once
    assert len(dhm.human_cache) == 3


# -- the benchmark ---------------------------------------------------------------------------


def test_the_load_benchmark_runs(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks/serve_load.py"), "--clients", "3", "--requests", "12",
                    "--warmup", "2", "--timeout-s", str(WAIT_S), "--json", str(out)],
                   check=True, cwd=REPO, timeout=120, capture_output=True)
    figures = json.loads(out.read_text())
    assert figures["failures"] == 0 and figures["requests"] == 12 and figures["requests_per_s"] > 0
    assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]


# -- limits at their exact bound, and what the guards must not let through -----------------------


def test_a_body_of_exactly_the_limit_is_accepted_also_when_chunked():
    data = json.dumps({"query": STORIES}).encode()
    spy = Spy()
    with run_in_thread(create_app(spy, limits=Limits(max_body_bytes=len(data)))) as url:
        headers = {"content-type": "application/json"}
        r = httpx.post(f"{url}/get_reward", content=data, headers=headers, timeout=WAIT_S)  # Content-Length
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected(STORIES)), r.text
        chunks = (data[k:k + 50] for k in range(0, len(data), 50))  # no Content-Length: counted while read
        r = httpx.post(f"{url}/get_reward", content=chunks, headers=headers, timeout=WAIT_S)
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected(STORIES)), r.text
        r = httpx.post(f"{url}/get_reward", content=(c for c in (data, b" ")), headers=headers, timeout=WAIT_S)
        assert r.status_code == 413  # one byte more
    assert spy.calls == [len(STORIES), len(STORIES)]


def test_exactly_the_most_stories_per_request_are_scored():
    spy = Spy()
    with run_in_thread(create_app(spy, limits=Limits(max_stories_per_request=len(STORIES)))) as url:
        r = post(url, {"query": STORIES})
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected(STORIES)), r.text
        assert post(url, {"query": [*STORIES, STORIES[0]]}).status_code == 422
    assert spy.calls == [len(STORIES)]


def test_a_sibling_directory_sharing_the_roots_name_is_outside_it(image_dirs):
    root, _ = image_dirs  # .../images
    sibling = root.parent / f"{root.name}2"  # .../images2: its path starts with the root's
    sibling.mkdir()
    Image.new("RGB", (4, 4)).save(sibling / "x.png")
    spy = Recorder()
    with run_in_thread(create_app(spy, limits=Limits(image_root=str(root)))) as url:
        for label in ({"images": [f"../{sibling.name}/x.png"]}, {"image_ids": [f"../{sibling.name}/x"]}):
            r = post(url, {"query": STORIES[:1], "labels": [label]})
            assert r.status_code == 422 and "outside" in r.json()["detail"], (label, r.text)
    assert spy.calls == []


def test_an_image_of_exactly_the_pixel_limit_is_scored(image_dirs):
    root, _ = image_dirs
    spy = Recorder()
    limits = Limits(image_root=str(root), max_image_pixels=100)  # a.png: 10 x 10
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        r = post(url, {"query": STORIES[:1], "labels": [{"images": ["a.png"]}]})
        assert r.status_code == 200 and r.json()["extra_logs"]["unscorable"] == [0.0], r.text
        assert r.json()["rewards"] == pytest.approx(expected(STORIES[:1]))
    assert spy.stories == STORIES[:1]


def test_an_image_named_by_id_over_the_pixel_limit_makes_its_story_unscorable_undecoded(image_dirs, monkeypatch):
    root, _ = image_dirs
    spy = Recorder()
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded"))
    limits = Limits(image_root=str(root), max_image_pixels=10_000)  # big.png has 20,000
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        labels = [{"image_ids": ["a"]}, {"image_ids": ["a", "big"]}]
        r = post(url, {"query": STORIES[:2], "labels": labels})
        assert r.status_code == 200, r.text
        assert r.json()["rewards"] == pytest.approx([*expected(STORIES[:1]), -1.0])
        assert r.json()["extra_logs"]["unscorable"] == [0.0, 1.0]
        assert info(url)["stats"]["unscorable_images"] == 1
    assert spy.stories == STORIES[:1]


def test_a_blocked_first_story_leaves_the_others_their_own_rewards_in_order(image_dirs):
    root, _ = image_dirs
    stories = [story(1), story(2), story(3)]
    own = expected(stories)
    assert len(set(own)) == 3  # distinct: a shifted answer shows
    spy = Recorder()
    limits = Limits(image_root=str(root), max_image_pixels=10_000)
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        labels = [{"images": ["big.png"]}, {"images": ["a.png"]}, {"images": ["a.png"]}]
        r = post(url, {"query": stories, "labels": labels})
        assert r.status_code == 200, r.text
        assert r.json()["rewards"] == pytest.approx([-1.0, *own[1:]])
        assert r.json()["extra_logs"]["unscorable"] == [1.0, 0.0, 0.0]
    assert spy.stories == stories[1:]


def test_an_image_replaced_by_a_larger_one_at_the_same_path_is_checked_again(image_dirs):
    root, _ = image_dirs
    Image.new("RGB", (10, 10)).save(root / "swap.png")
    spy = Recorder()
    limits = Limits(image_root=str(root), max_image_pixels=10_000)
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        body = {"query": STORIES[:1], "labels": [{"images": ["swap.png"]}]}
        assert post(url, body).json()["extra_logs"]["unscorable"] == [0.0]
        Image.new("RGB", (200, 100)).save(root / "swap.png")  # 20,000 pixels, same path
        r = post(url, body)
        assert r.json()["extra_logs"]["unscorable"] == [1.0] and r.json()["rewards"] == [-1.0], r.text
    assert spy.stories == STORIES[:1]


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (no pixel data)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def test_an_image_over_pils_own_bound_makes_its_story_unscorable_undecoded(image_dirs, monkeypatch):
    root, _ = image_dirs
    (root / "bomb.png").write_bytes(_png_header(50_000, 50_000))  # 2.5e9 pixels: PIL refuses to open it
    with pytest.raises(Image.DecompressionBombError):
        Image.open(root / "bomb.png")
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("decoded"))
    spy = Recorder()
    limits = Limits(image_root=str(root), max_image_pixels=10**12)  # not ours: PIL's bound decides
    with run_in_thread(create_app(spy, limits=limits, fallback=-1.0)) as url:
        r = post(url, {"query": STORIES[:2], "labels": [{"images": ["a.png"]}, {"images": ["bomb.png"]}]})
        assert r.status_code == 200, r.text
        assert r.json()["rewards"] == pytest.approx([*expected(STORIES[:1]), -1.0])
        assert r.json()["extra_logs"]["unscorable"] == [0.0, 1.0]
    assert spy.stories == STORIES[:1]


def test_a_token_sent_under_another_scheme_is_refused():
    spy = Spy()
    with run_in_thread(create_app(spy, token="s3cret")) as url:
        for scheme in ("Basic", "Token", "Digest"):
            r = post(url, {"query": STORIES}, headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 401, (scheme, r.text)
        assert post(url, {"query": STORIES}, headers={"Authorization": "bearer s3cret"}).status_code == 200
    assert spy.calls == [len(STORIES)]


def test_the_token_is_checked_before_the_body_size():
    spy = Spy()
    with run_in_thread(create_app(spy, token="s3cret", limits=Limits(max_body_bytes=100))) as url:
        big = {"query": ["A long story. " * 100]}
        r = post(url, big)  # Content-Length over the limit, no token
        assert r.status_code == 401, r.text
        r = httpx.post(f"{url}/get_reward", content=(b"x" * 100 for _ in range(5)), timeout=WAIT_S)  # chunked
        assert r.status_code == 401, r.text
        assert post(url, big, headers={"Authorization": "Bearer s3cret"}).status_code == 413
    assert spy.calls == []


# -- time limits and batching delays --------------------------------------------------------------


def test_requests_queued_behind_a_call_past_the_time_limit_get_503_at_once():
    spy = Spy()
    with run_in_thread(create_app(spy, timeout_s=5, max_wait_ms=0)) as url:
        answers = {}
        first = threading.Thread(target=lambda: answers.setdefault("a", post(url, {"query": ["WAIT here. WAIT."]},
                                                                             timeout=20)))
        first.start()
        _until(lambda: spy.calls)  # the call runs (and waits for the gate)
        second = threading.Thread(target=lambda: answers.setdefault("b", post(url, {"query": STORIES})))
        second.start()
        # queued before the time limit: a request after it is refused without being counted
        _until(lambda: info(url)["stats"]["requests"] == 2, timeout=4.5)
        _join(first, timeout=20)
        assert answers["a"].status_code == 504
        second.join(8)  # the stuck call holds the gate for 20 s: only an answer given at once comes in time
        assert "b" in answers, "the queued request waited for the stuck call"
        assert answers["b"].status_code == 503 and "busy" in answers["b"].json()["detail"]
        spy.gate.set()
    assert spy.calls == [1]


def test_a_lone_request_waits_max_wait_ms_for_company_then_is_scored():
    import asyncio

    import storyrl.integrations as core

    async def main():
        batcher = RequestBatcher(lambda stories, contexts, prompts: core.Scored(np.ones(len(stories))),
                                 max_wait_ms=400)
        await batcher.start()
        try:
            start = time.monotonic()
            scored = await asyncio.wait_for(batcher.submit(["a story."], [{}]), 5)  # 400 s if read as seconds
            return time.monotonic() - start, scored
        finally:
            await batcher.stop()

    waited, scored = asyncio.run(main())
    assert list(scored.scores) == [1.0]
    assert 0.35 <= waited < 2.5, waited  # 0.4 s, and not ten times that


# -- the command line reaches the server ---------------------------------------------------------


def test_every_serve_option_reaches_the_app_the_limits_and_the_server(monkeypatch, tmp_path):
    made, served = [], []
    real = server_module.create_app

    def record_app(reward, **kwargs):
        made.append((reward, kwargs))
        return real(reward, **kwargs)

    monkeypatch.setattr(server_module, "create_app", record_app)
    monkeypatch.setattr(server_module, "serve", lambda app, **kwargs: served.append((app, kwargs)))
    args = ["--host", "127.0.0.2", "--port", "5123", "--token", "t0k", "--max-batch-size", "7",
            "--max-wait-ms", "12.5", "--timeout-s", "3.5", "--max-body-bytes", "4321",
            "--max-stories-per-request", "9", "--max-story-chars", "321", "--image-root", str(tmp_path),
            "--max-image-pixels", "777", "--receive-timeout-s", "7.5", "--max-connections", "55",
            "--shutdown-timeout-s", "4.5", "--docs", "--fallback", "-2.5",
            "--log-level", "debug"]
    result = _invoke(args)
    assert result.exit_code == 0, result.output
    (reward, kwargs), = made
    assert reward.name == "repetition"
    assert kwargs == {"max_batch_size": 7, "max_wait_ms": 12.5, "fallback": -2.5, "timeout_s": 3.5, "token": "t0k",
                      "docs": True, "limits": Limits(max_body_bytes=4321, max_stories_per_request=9,
                                                     max_story_chars=321, max_image_pixels=777,
                                                     image_root=str(tmp_path), receive_timeout_s=7.5,
                                                     max_connections=55)}
    (app, served_kwargs), = served
    assert app.state.reward is reward and app.state.limits is kwargs["limits"]
    assert served_kwargs == {"host": "127.0.0.2", "port": 5123, "log_level": "debug", "shutdown_timeout_s": 4.5}
    # the defaults arrive too
    made.clear(), served.clear()
    assert _invoke([]).exit_code == 0
    assert made[0][1]["limits"] == Limits() and made[0][1]["timeout_s"] == 60.0
    assert served[0][1]["shutdown_timeout_s"] == 10.0 and served[0][1]["port"] == 5000


# -- shutdown lets a short call finish -------------------------------------------------------------

_SLOW_SERVER = """
import sys, time
import numpy as np
from storyrl.cli import main
from storyrl.rewards import Reward, register_reward

@register_reward()
class Slow(Reward):
    name = "test_slow"

    def _score_batch(self, stories, **context):
        time.sleep(1.5)
        return np.full(len(stories), 0.25)

main(sys.argv[1:], prog_name="storyrl")
"""


def test_a_signal_during_a_short_call_lets_its_request_finish(tmp_path):
    with _served_in_a_process(tmp_path, _SLOW_SERVER, "test_slow", 10) as (proc, url, log):
        answer, client = _in_flight(url, {"query": STORIES[:2]})
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        _join(client)
    assert answer["r"].status_code == 200, (answer["r"].text, log.read_text())
    assert answer["r"].json()["rewards"] == [0.25, 0.25]


def test_stopping_answers_a_request_that_waits_for_company():
    # the request has left the queue for the batch being gathered (max_wait_ms), not yet running
    import asyncio

    import storyrl.integrations as core
    from storyrl.integrations.batching import Closing

    async def main():
        batcher = RequestBatcher(lambda stories, contexts, prompts: core.Scored(np.ones(len(stories))),
                                 max_wait_ms=30_000)
        await batcher.start()
        job = asyncio.ensure_future(batcher.submit(["a story."], [{}]))
        for _ in range(100):  # the worker takes it off the queue
            await asyncio.sleep(0.01)
            if not batcher._jobs:
                break
        assert not batcher._jobs and not job.done()
        await batcher.stop()
        with pytest.raises(Closing):
            await asyncio.wait_for(job, 5)

    asyncio.run(main())


# -- slow clients: the time to send a request, and the connections open -----------------------------


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> bytes:
    """Reads until the server closes ``sock`` (sending ``drip`` a byte every
    0.1 s meanwhile); returns what it answered. Fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    answer = b""
    sock.settimeout(0.1)
    while time.monotonic() < deadline:
        try:
            if drip:
                sock.sendall(drip[:1])
                drip = drip[1:] or drip  # the last byte again and again: never a whole request
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return answer
        if not chunk:
            return answer
        answer += chunk
    pytest.fail(f"the server kept the connection open for {seconds} s; got {answer!r}")


@pytest.mark.parametrize("sent, drip", [
    (b"", b""),  # connects and sends nothing
    (b"POST /get_reward HTTP/1.1\r\n", b"X-Slow: " + b"a" * 50),  # the headers, a byte at a time
    (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t0k\r\nContent-Type: application/json\r\n"
     b"Content-Length: 100000\r\n\r\n", b'{"query": ["a story that never ends'),  # the body, a byte at a time
])
def test_a_request_not_sent_within_receive_timeout_s_is_closed_token_or_not(sent, drip):
    """Bytes trickled every 0.1 s do not keep a connection: the request must
    be in within receive_timeout_s, counted from the connection, and no
    token is needed to hold a socket, so the bound holds with one too."""
    spy = Spy()
    with run_in_thread(create_app(spy, token="t0k", limits=Limits(receive_timeout_s=0.5))) as url:
        with socket.create_connection(_address(url)) as sock:
            sock.sendall(sent)
            answer = _closed_within(sock, 10, drip)
        assert answer == b"" if not sent else answer.startswith(b"HTTP/1.1 408 ")
        if sent:
            assert b"--receive-timeout-s" in answer
        assert info(url, headers={"Authorization": "Bearer t0k"}, timeout=5)["stats"]["receive_timeouts"] == 1
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
    assert spy.calls == []


def _health_answer(sock: socket.socket) -> bytes:
    """GET /health on a kept-alive ``sock``; its whole answer (5 s at most per read)."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):
        answer += sock.recv(4096) or pytest.fail(f"closed after {answer!r}")
    return answer


def test_the_next_request_on_a_kept_alive_connection_is_timed_from_the_answer():
    with run_in_thread(create_app(Spy(), limits=Limits(receive_timeout_s=0.5))) as url:
        with socket.create_connection(_address(url)) as sock:
            assert _health_answer(sock).startswith(b"HTTP/1.1 200 ")
            # uvicorn's own keep-alive timer restarts with every byte: this drip would hold it for ever
            answer = _closed_within(sock, 10, b"GET /health HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaa")
        assert answer.startswith(b"HTTP/1.1 408 ")


def test_an_idle_kept_alive_connection_closes_without_a_word():
    """After an answer, a connection that sends nothing more is closed at
    receive_timeout_s with no bytes: an unasked 408 would be read by a
    pooled client as the answer to its next request."""
    with run_in_thread(create_app(Spy(), limits=Limits(receive_timeout_s=0.5))) as url:
        with socket.create_connection(_address(url)) as sock:
            _health_answer(sock)
            assert _closed_within(sock, 10) == b""


def test_a_request_received_in_time_is_not_cut_while_the_reward_scores_it():
    spy = Spy()
    with run_in_thread(create_app(spy, limits=Limits(receive_timeout_s=0.3))) as url:
        answer = {}
        client = threading.Thread(target=lambda: answer.setdefault("r", post(url, {"query": ["WAIT here. WAIT."]})))
        client.start()
        _until(lambda: spy.calls)
        time.sleep(1.0)  # three times receive_timeout_s, the request being scored
        spy.gate.set()
        client.join(8)
        assert not client.is_alive() and answer["r"].status_code == 200
        assert "receive_timeouts" not in info(url, timeout=5)["stats"]


def test_past_max_connections_a_new_one_closes_the_oldest_still_sending():
    """20 half-sent requests against max_connections 3 (and a receive time
    of a minute): /health gets in at once, the oldest slow sockets are
    closed; a connection whose request is being scored is never the one
    closed, and when all are, the newcomer gets 503."""
    spy = Spy()
    app = create_app(spy, max_wait_ms=0, limits=Limits(receive_timeout_s=60, max_connections=3))
    with run_in_thread(app) as url:
        held = _hold_the_worker(url, spy)  # one connection answering
        slow = [socket.create_connection(_address(url)) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /heal")
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        stats = info(url, timeout=5)["stats"]
        assert stats["evicted_connections"] >= 18 and not stats.get("refused_connections")
        for sock in slow[:15]:  # the oldest are gone
            answer = _closed_within(sock, 10)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 ")
            sock.close()
        for sock in slow[15:]:
            sock.close()
        # every connection busy with a request being scored: a newcomer is refused
        busy = [threading.Thread(target=post, args=(url, {"query": [f"WAIT {i}. WAIT."]})) for i in range(2)]
        for thread in busy:
            thread.start()
        _until(lambda: app.state.batcher.stats["requests"] == 3)  # (asking /info would take a connection)
        refused = httpx.get(f"{url}/health", timeout=5)
        assert refused.status_code == 503 and "--max-connections" in refused.json()["detail"]
        spy.gate.set()
        for thread in [held, *busy]:
            thread.join(8)
            assert not thread.is_alive()
        assert info(url, timeout=5)["stats"]["refused_connections"] >= 1
    assert spy.calls[0] == 1  # the held request was scored, not closed


_LOW_FILE_LIMIT = 512


def test_half_sent_requests_beyond_the_file_limit_leave_health_answering(tmp_path):
    """The issue's case, smaller: `storyrl serve` under a file limit of 512
    and 700 half-sent requests (no token needed). Without a connection cap
    the server runs out of files and stops accepting -- /health included --
    until the sockets close; with it (here 512 - 256 - 64 = 192 by default:
    files for a backlog's burst and the server's own) /health answers at
    once and no accept runs out of files."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1000:
        if hard != resource.RLIM_INFINITY and hard < 1000:
            pytest.skip(f"this process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1000, hard))

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (_LOW_FILE_LIMIT, _LOW_FILE_LIMIT))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "storyrl", "serve", "--config",
                                 str(REPO / "configs/rewards/repetition.yaml"), "--port", str(port),
                                 "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                preexec_fn=low_limit)
    slow = []
    try:
        _until(lambda: proc.poll() is not None or _healthy(url), timeout=60)
        assert proc.poll() is None, log.read_text()
        for _ in range(700):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
            slow.append(sock)
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
        assert info(url, timeout=5)["stats"]["evicted_connections"] >= 700 - 192
    finally:
        for sock in slow:
            sock.close()
        proc.kill()
        proc.wait(10)
    assert "Too many open files" not in log.read_text()


def test_an_explicit_max_connections_beyond_the_file_limit_is_refused(monkeypatch):
    import resource

    from storyrl.integrations.serve_guards import connection_budget

    set_to = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 1024))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: set_to.append(limits))
    monkeypatch.setattr(server_module, "serve", lambda *a, **k: pytest.fail("served past the file limit"))
    result = _invoke(["--max-connections", "2000"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--max-connections" in result.output and "at most 1024 (ulimit -Hn)" in result.output
    assert "--max-connections 704 or less" in result.output and set_to == []
    # within the hard limit the soft one is raised to hold it (plus 256 + 64); the default fits the hard limit
    assert connection_budget(600) == 600 and set_to == [(920, 1024)]
    assert connection_budget(None) == 704 and set_to[-1] == (1024, 1024)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100_000, resource.RLIM_INFINITY))
    assert connection_budget(None) == 1000 and len(set_to) == 2
