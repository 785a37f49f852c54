"""``storyrl serve``: the HTTP reward server (OpenRLHF's remote reward
protocol). FastAPI and uvicorn are imported only when the command runs."""

from __future__ import annotations

import math
from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail

TOKEN_ENV = "STORYRL_SERVE_TOKEN"


class _Finite(click.FloatRange):
    """A float range that refuses inf and nan (nan passes every bound)."""

    def _describe_range(self) -> str:  # unbounded: the help would read "x<=None"
        return "finite" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


@click.command("serve")
@click.option("--config", "config", required=True, type=_FILE,
              help="Reward config YAML (configs/rewards/*.yaml): reward: <name> plus its options.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface; then set a token).")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: a free one).")
@click.option("--token", envvar=TOKEN_ENV, default=None, show_envvar=True,
              help="Clients must send 'Authorization: Bearer TOKEN' (all but /health). Prefer the environment "
                   "variable: the command line is visible to other users.")
@click.option("--max-batch-size", default=64, show_default=True, type=click.IntRange(min=1),
              help="Most stories gathered from concurrent requests into one reward call "
                   "(a larger request is scored alone).")
@click.option("--max-wait-ms", default=10.0, show_default=True, type=_Finite(0, 60_000),
              help="How long the first waiting request waits for others to join its batch.")
@click.option("--timeout-s", default=60.0, show_default=True, type=_Finite(0, min_open=True),
              help="Most seconds one reward call may take: its requests then get 504, and new ones 503 "
                   "until it returns.")
@click.option("--max-body-bytes", default=16 << 20, show_default=True, type=click.IntRange(min=1),
              help="Largest request body (413 beyond).")
@click.option("--max-stories-per-request", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Most stories in one request (422 beyond).")
@click.option("--max-story-chars", default=20_000, show_default=True, type=click.IntRange(min=1),
              help="Most characters of one story, end markers included (422 beyond).")
@click.option("--image-root", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Directory the image paths and ids of labels are resolved in; nothing outside it is opened. "
                   "Without it, requests naming images get 422.")
@click.option("--max-image-pixels", default=40_000_000, show_default=True, type=click.IntRange(min=1),
              help="Larger images (width x height, from the header) make their story unscorable, undecoded.")
@click.option("--receive-timeout-s", default=30.0, show_default=True, type=_Finite(0, 3600, min_open=True),
              help="Most seconds a client may take to send a request, headers and body, from connecting (or "
                   "from the previous answer on its connection); then 408 and the connection closes.")
@click.option("--max-connections", type=click.IntRange(min=1), default=None,
              help="Most connections open at once; one more closes the oldest one still sending its request. "
                   "[default: 1000, fewer when the file limit (ulimit -Hn) is lower; the soft limit is raised "
                   "to fit]")
@click.option("--shutdown-timeout-s", default=10.0, show_default=True, type=_Finite(0, 3600),
              help="On SIGTERM/SIGINT, how long open requests may finish before they get 503.")
@click.option("--prepare-data", type=_FILE, default=None,
              help="Stories file (JSONL, VIST SIS, VWP) whose images (resolved in --image-root) are embedded "
                   "before listening, with the human stories of dhm scored, so that requests only do text work.")
@click.option("--docs/--no-docs", default=False, show_default=True, help="Serve /docs and /openapi.json.")
@click.option("--fallback", type=_Finite(), default=None,
              help="Reward of an unscorable story (JSON has no NaN) [default: $STORYRL_REWARD_FALLBACK or 0.0].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
def serve(config: Path, host: str, port: int, token: str | None, max_batch_size: int, max_wait_ms: float,
          timeout_s: float, max_body_bytes: int, max_stories_per_request: int, max_story_chars: int,
          image_root: Path | None, max_image_pixels: int, receive_timeout_s: float, max_connections: int | None,
          shutdown_timeout_s: float, prepare_data: Path | None, docs: bool, fallback: float | None,
          log_level: str) -> None:
    """Serve the reward of CONFIG over HTTP for OpenRLHF (--remote_rm_url
    http://HOST:PORT/get_reward) and other trainers: POST /get_reward with
    {"query": [...], "prompts": [...], "labels": [...]} answers {"rewards":
    [...], "scores": [...], "extra_logs": {...}}; GET /health, GET /info.
    Concurrent requests are batched onto one reward model. The reward's
    models are loaded before the server listens."""
    try:
        from storyrl.integrations.server import Limits, create_app
        from storyrl.integrations.server import serve as serve_app
    except ImportError as exc:
        _fail(f"storyrl serve needs FastAPI and uvicorn: pip install 'storyrl[serve]' ({exc})")
    from storyrl.integrations import resolve_fallback
    from storyrl.integrations.serve_guards import connection_budget, is_loopback
    from storyrl.rewards import load_reward_config

    if token is not None and not token.strip():
        _fail(f"--token / {TOKEN_ENV} is empty")
    fallback = resolve_fallback(fallback)
    limits = Limits(max_body_bytes=max_body_bytes, max_stories_per_request=max_stories_per_request,
                    max_story_chars=max_story_chars, max_image_pixels=max_image_pixels,
                    image_root=None if image_root is None else str(image_root),
                    receive_timeout_s=receive_timeout_s, max_connections=max_connections)
    try:
        connection_budget(max_connections)  # before the models load: a file limit too low fails at once
    except ValueError as exc:
        _fail(f"--max-connections: {exc}")
    reward = load_reward_config(config).setup()  # a bad config or model fails here, before listening
    if prepare_data is not None:
        from storyrl.integrations.server import prepare_for_data
        from storyrl.rewards.base import RewardError

        try:
            counts = prepare_for_data(reward, str(prepare_data), None if image_root is None else str(image_root))
        except (ValueError, RewardError) as exc:
            _fail(f"--prepare-data {prepare_data}: {exc}")
        click.echo(f"storyrl serve: prepared {prepare_data}: {counts}", err=True)
    app = create_app(reward, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, fallback=fallback,
                     limits=limits, timeout_s=timeout_s, token=token, docs=docs)
    if not is_loopback(host) and token is None:
        click.echo(f"storyrl serve: WARNING: listening on {host} without a token: anyone who can reach the port "
                   f"can use the reward and read /info; set {TOKEN_ENV} (or --token)", err=True)
    click.echo(f"storyrl serve: reward {reward.name!r} from {config} on http://{host}:{port}/get_reward", err=True)
    serve_app(app, host=host, port=port, log_level=log_level, shutdown_timeout_s=shutdown_timeout_s)
