"""Ablation command: ``ablate`` (reward variants -> trained policies or
fixed story files -> scores, d_HM table and plot), over
:func:`storyrl.eval.ablation.run_ablation`."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail


@click.command()
@click.option("--config", "-c", "config_path", required=True, type=_FILE,
              help="Ablation config YAML (configs/ablations/*.yaml): output_dir, train and variants (or stories), "
                   "eval.")
@click.option("--only", "only", multiple=True, metavar="VARIANT",
              help="Run only this variant (repeatable); the table also holds the others that finished earlier.")
@click.option("--overwrite", is_flag=True,
              help="Redo what was made with other options instead of failing: a changed variant from scratch, "
                   "every score file when the metrics changed.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def ablate(config_path: Path, only: tuple[str, ...], overwrite: bool, quiet: bool) -> None:
    """Train the base RL config once per reward variant, generate stories
    for the held-out sequences with every trained policy (or take each
    variant's fixed story file), score them and the human stories with the
    metrics, and write OUTPUT_DIR/ablation.csv, ablation.md and
    ablation.png (metric means, d_G, d_C, d_R and d_HM per variant).
    Finished variants are never redone; rerun the same command to continue
    an interrupted ablation. Exits non-zero when no variant has a story."""
    from storyrl.data import StoryDataError
    from storyrl.eval.ablation import AblationConfig, run_ablation
    from storyrl.output_files import OutputError

    try:
        config = AblationConfig.from_yaml(config_path)
        result = run_ablation(config, progress=not quiet, only=list(only) or None, overwrite=overwrite)
    except (TypeError, ValueError, StoryDataError, OutputError) as exc:
        _fail(str(exc))
    click.echo(result.markdown)
    for name, path in result.paths.items():
        click.echo(f"{name}: {path}")
    if not any(v.stories for v in result.variants):
        _fail("no variant produced a story (see the table)")
