"""Benchmark: ``storyrl serve`` against slow clients -- how fast ``/health``
answers while many sockets hold half-sent requests, and how long the server
lets them hold a connection.

What is measured
----------------
A real ``storyrl serve`` process (``configs/rewards/repetition.yaml``, no
token: a slow socket needs none) runs under a file limit of
``--server-file-limit`` (1024 by default, a common ``ulimit -n``).
``--sockets`` connections are opened in this process, as fast as they go;
each sends part of a request (``--mode``: ``idle`` sends nothing,
``headers`` the start of the headers, ``body`` the headers and the start of
a body) and then one more byte every ``--drip-s`` seconds (never a whole
request), for ``--hold-s`` seconds. Meanwhile a probe opens a fresh
connection every 0.5 s and times ``GET /health`` (a probe over
``--probe-timeout-s`` counts as a timeout at that time). Reported: the probes'
latency (median, max) and timeouts, how many slow sockets connected, how
many the server closed and after how long (median seconds held), and the
most files the server held open at once (``/proc``, Linux). Extra ``storyrl
serve`` options go after ``--``. ``--checkout DIR`` serves the storyrl of
another checkout (say an export of an older commit), for a before/after.

    python benchmarks/serve_slow_clients.py --sockets 2000
    python benchmarks/serve_slow_clients.py --sockets 2000 -- --receive-timeout-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPENERS = {
    "idle": b"",
    "headers": b"POST /get_reward HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    "body": b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            b'{"query": ["',
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ms(port: int, timeout: float) -> float | None:
    """One GET /health on a fresh connection: milliseconds, None past ``timeout``."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(max(timeout - (time.perf_counter() - start), 0.01))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while b'"ok"' not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    return None
                answer += chunk
    except OSError:  # a timeout, a refusal or a reset: no answer
        return None
    return (time.perf_counter() - start) * 1000


def start_server(port: int, args) -> subprocess.Popen:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.server_file_limit, args.server_file_limit))

    cmd = [sys.executable, "-m", "storyrl", "serve", "--config", str(REPO / "configs/rewards/repetition.yaml"),
           "--port", str(port), "--log-level", "warning", *args.serve_args]
    env = {**os.environ, "PYTHONPATH": str(args.checkout)}  # its storyrl first (-m puts the cwd first too)
    proc = subprocess.Popen(cmd, cwd=args.checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=limit)
    deadline = time.monotonic() + 120
    while health_ms(port, 1.0) is None:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not come up within 120 s")
        time.sleep(0.2)
    return proc


class FileWatch(threading.Thread):
    """The most files the server process held open (Linux /proc)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path, self.most, self.stop = Path(f"/proc/{pid}/fd"), 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.most = max(self.most, len(os.listdir(self.path)))
            except OSError:
                return
            time.sleep(0.02)


async def slow_socket(port: int, opener: bytes, args, held: list, connected: list) -> None:
    """One slow client: connect, send the opener, drip; records the seconds
    until the server closed the connection."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), args.connect_timeout_s)
    except (OSError, asyncio.TimeoutError):
        return
    connected.append(1)
    start = time.monotonic()
    try:
        writer.write(opener)
        deadline = start + args.hold_s
        while time.monotonic() < deadline:
            try:  # a read returning (data or EOF) within drip_s means the server answered or closed
                data = await asyncio.wait_for(reader.read(4096), args.drip_s)
            except asyncio.TimeoutError:
                writer.write(b"a")  # one more byte, never the end of a request
                await writer.drain()
                continue
            if not data:
                held.append(time.monotonic() - start)
                return
    except OSError:
        held.append(time.monotonic() - start)
    finally:
        writer.close()


async def probe(port: int, args, until: float, latencies: list) -> None:
    while time.monotonic() < until:
        latencies.append(await asyncio.to_thread(health_ms, port, args.probe_timeout_s))
        await asyncio.sleep(0.5)


async def attack(port: int, args) -> dict:
    held, connected, latencies = [], [], []
    opener = OPENERS[args.mode]
    start = time.monotonic()
    clients = [asyncio.create_task(slow_socket(port, opener, args, held, connected)) for _ in range(args.sockets)]
    await asyncio.sleep(1.0)  # let the flood arrive
    await probe(port, args, start + args.hold_s, latencies)
    await asyncio.gather(*clients)
    answered = [x for x in latencies if x is not None]
    return {"sockets": args.sockets, "connected": len(connected), "closed_by_server": len(held),
            "median_held_s": round(statistics.median(held), 2) if held else None,
            "probes": len(latencies), "probe_timeouts": len(latencies) - len(answered),
            "health_p50_ms": round(statistics.median(answered), 1) if answered else None,
            "health_max_ms": round(max(answered), 1) if answered else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=2000)
    parser.add_argument("--mode", choices=sorted(OPENERS), default="headers")
    parser.add_argument("--drip-s", type=float, default=0.5, help="seconds between the bytes a slow socket sends")
    parser.add_argument("--hold-s", type=float, default=15.0, help="how long the slow sockets try to stay")
    parser.add_argument("--server-file-limit", type=int, default=1024, help="the server's ulimit -n")
    parser.add_argument("--probe-timeout-s", type=float, default=5.0)
    parser.add_argument("--connect-timeout-s", type=float, default=5.0)
    parser.add_argument("--checkout", type=Path, default=REPO, help="the storyrl checkout to serve")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("serve_args", nargs="*", help="after --: extra storyrl serve options")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.sockets + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise SystemExit(f"{args.sockets} sockets need {need} open files here; ulimit -Hn is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    port = free_port()
    proc = start_server(port, args)
    watch = FileWatch(proc.pid)
    watch.start()
    try:
        quiet = [health_ms(port, args.probe_timeout_s) for _ in range(5)]
        figures = asyncio.run(attack(port, args))
        time.sleep(1.0)
        after = health_ms(port, args.probe_timeout_s)
    finally:
        watch.stop.set()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    quiet = [x for x in quiet if x is not None]
    figures.update({"mode": args.mode, "drip_s": args.drip_s, "hold_s": args.hold_s,
                    "server_file_limit": args.server_file_limit, "serve_args": args.serve_args,
                    "health_quiet_ms": round(statistics.median(quiet), 1) if quiet else None,
                    "health_after_ms": None if after is None else round(after, 1),
                    "server_most_files": watch.most or None, "python": platform.python_version(),
                    "cpus": os.cpu_count(), "checkout": str(args.checkout)})
    print(json.dumps(figures, indent=1))
    print(f"{figures['connected']}/{args.sockets} slow sockets ({args.mode}): /health p50 "
          f"{figures['health_p50_ms']} ms, max {figures['health_max_ms']} ms, {figures['probe_timeouts']} of "
          f"{figures['probes']} probes timed out ({args.probe_timeout_s:g} s); the server closed "
          f"{figures['closed_by_server']} after {figures['median_held_s']} s (median); at most "
          f"{figures['server_most_files']} files open")
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
