"""Sweep command: ``sweep`` (models × settings × prompts -> stories, scores
and d_HM tables), over :func:`storyrl.eval.sweep.run_sweep`."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail


@click.command()
@click.option("--config", "-c", "config_path", required=True, type=_FILE,
              help="Sweep config YAML (configs/sweeps/*.yaml): data, output_dir, models, settings, prompts, rewards.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def sweep(config_path: Path, quiet: bool) -> None:
    """Generate stories for every model × setting × prompt of the config,
    score them and the human stories with the d_HM rewards, and write
    OUTPUT_DIR/dhm.csv, dhm.md and dhm.png (d_HM per cell and the mean over
    prompts, as in the d_HM paper). Finished cells are never redone; rerun
    the same command to continue an interrupted sweep. Multi-GPU:
    `accelerate launch -m storyrl sweep --config ...` shards the stories
    across processes. Exits non-zero when no cell has a d_HM."""
    from storyrl.data import StoryDataError
    from storyrl.eval.sweep import SweepConfig, run_sweep
    from storyrl.output_files import OutputError

    try:
        config = SweepConfig.from_yaml(config_path)
        result = run_sweep(config, progress=not quiet)
    except (TypeError, ValueError, StoryDataError, OutputError) as exc:
        _fail(str(exc))
    if result is None:  # a non-main process of a multi-process run: the main one reports
        return
    click.echo(result.markdown)
    for name, path in result.paths.items():
        click.echo(f"{name}: {path}")
    if not any(c.n for c in result.cells):
        _fail("no cell has a d_HM: no generated story was scorable in every dimension (see the table)")
