"""``storyrl serve``: the HTTP reward server (OpenRLHF's remote reward
protocol). FastAPI and uvicorn are imported only when the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail


@click.command("serve")
@click.option("--config", "config", required=True, type=_FILE,
              help="Reward config YAML (configs/rewards/*.yaml): reward: <name> plus its options.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface; the server has no authentication).")
@click.option("--port", default=5000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: a free one).")
@click.option("--max-batch-size", default=64, show_default=True, type=click.IntRange(min=1),
              help="Most stories gathered from concurrent requests into one reward call "
                   "(a larger request is scored alone).")
@click.option("--max-wait-ms", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="How long the first waiting request waits for others to join its batch.")
@click.option("--fallback", type=float, default=None,
              help="Reward of an unscorable story (JSON has no NaN) [default: $STORYRL_REWARD_FALLBACK or 0.0].")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]), help="uvicorn's log level.")
def serve(config: Path, host: str, port: int, max_batch_size: int, max_wait_ms: float, fallback: float | None,
          log_level: str) -> None:
    """Serve the reward of CONFIG over HTTP for OpenRLHF (--remote_rm_url
    http://HOST:PORT/get_reward) and other trainers: POST /get_reward with
    {"query": [...], "prompts": [...], "labels": [...]} answers {"rewards":
    [...], "scores": [...], "extra_logs": {...}}; GET /health, GET /info.
    Concurrent requests are batched onto one reward model. The reward's
    models are loaded before the server listens."""
    try:
        import uvicorn

        from storyrl.integrations.server import create_app
    except ImportError as exc:
        _fail(f"storyrl serve needs FastAPI and uvicorn: pip install 'storyrl[serve]' ({exc})")
    from storyrl.integrations import resolve_fallback
    from storyrl.rewards import load_reward_config

    fallback = resolve_fallback(fallback)
    reward = load_reward_config(config).setup()  # a bad config or model fails here, before listening
    app = create_app(reward, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, fallback=fallback)
    click.echo(f"storyrl serve: reward {reward.name!r} from {config} on http://{host}:{port}/get_reward", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
