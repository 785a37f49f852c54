"""Benchmark: ``storyrl serve`` under load -- requests per second and
latency percentiles with many concurrent clients and a model-free reward.

What is timed
-------------
A real ``storyrl serve`` process (``python -m storyrl serve --config
configs/rewards/repetition.yaml``, default limits, no token) on the loopback
interface; ``--clients`` asyncio clients (httpx, one keep-alive connection
each) in this process send ``--requests`` requests in all, each of
``--stories`` distinct stories (prompt + story + ``</s>`` with a prompt, as
OpenRLHF sends them), one request after the other per client. Latency is the
wall time of one request as the client sees it (send, queue, batch, score,
answer). Throughput is completed requests over the wall time of the timed
phase. ``--warmup`` requests (not timed) go first. Every answer is checked:
status 200 and one reward per story; failures are counted and make the exit
status 1.

The server's ``/info`` afterwards gives the reward calls and their mean size
(how much batching happened). Client and server share the machine: on few
cores the clients' own CPU time is part of what limits the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def story(i: int) -> str:
    return f"Story {i} begins here. " + " ".join(f"Day {k} came and day {k} went by." for k in range(i % 7 + 2))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, port: int, args) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "storyrl", "serve", "--config", str(config), "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-wait-ms", str(args.max_wait_ms),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            sys.exit("the server did not come up within 60 s")
        time.sleep(0.1)


async def load(url: str, n_requests: int, clients: int, stories: int, offset: int,
               timeout_s: float = 120.0) -> tuple[list[float], int, float]:
    import httpx

    bodies = []
    for r in range(n_requests):
        prompts = [f"<s>[INST] Tell story {offset + r}.{k} [/INST]" for k in range(stories)]
        texts = [story((offset + r) * stories + k) for k in range(stories)]
        bodies.append({"query": [p + " " + t + "</s>" for p, t in zip(prompts, texts)], "prompts": prompts,
                       "labels": [None] * stories})
    latencies: list[float] = []
    failures = 0
    next_request = iter(range(n_requests))

    async def client() -> None:
        nonlocal failures
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            for r in next_request:
                start = time.perf_counter()
                try:
                    answer = await http.post(f"{url}/get_reward", json=bodies[r])
                    ok = answer.status_code == 200 and len(answer.json()["rewards"]) == stories
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - start)
                failures += not ok

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, failures, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/rewards/repetition.yaml")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=3000, help="timed requests, all clients together")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--stories", type=int, default=4, help="stories per request")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="a request unanswered this long is a failure")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args(argv)
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.config, port, args)
    try:
        if args.warmup:
            asyncio.run(load(url, args.warmup, args.clients, args.stories, 0, args.timeout_s))
        before = httpx.get(f"{url}/info").json()
        latencies, failures, wall = asyncio.run(load(url, args.requests, args.clients, args.stories, args.warmup,
                                                     args.timeout_s))
        after = httpx.get(f"{url}/info").json()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    calls = after["stats"].get("reward_calls", 0) - before["stats"].get("reward_calls", 0)
    scored = after["stats"].get("stories", 0) - before["stats"].get("stories", 0)
    figures = {
        "clients": args.clients, "requests": args.requests, "stories_per_request": args.stories,
        "max_batch_size": args.max_batch_size, "max_wait_ms": args.max_wait_ms,
        "requests_per_s": args.requests / wall, "stories_per_s": args.requests * args.stories / wall,
        "p50_ms": 1000 * percentile(latencies, 50), "p90_ms": 1000 * percentile(latencies, 90),
        "p99_ms": 1000 * percentile(latencies, 99), "max_ms": 1000 * max(latencies),
        "mean_ms": 1000 * statistics.fmean(latencies), "failures": failures,
        "reward_calls": calls, "mean_stories_per_call": scored / calls if calls else 0.0,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }
    print(f"{args.clients} clients, {args.requests} requests of {args.stories} stories "
          f"(reward: {args.config.name}, {figures['cpus']} CPUs)")
    print(f"  {figures['requests_per_s']:.0f} requests/s ({figures['stories_per_s']:.0f} stories/s)")
    print(f"  latency p50 {figures['p50_ms']:.1f} ms, p90 {figures['p90_ms']:.1f} ms, "
          f"p99 {figures['p99_ms']:.1f} ms, max {figures['max_ms']:.1f} ms")
    print(f"  {calls} reward calls, {figures['mean_stories_per_call']:.1f} stories per call; failures: {failures}")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
