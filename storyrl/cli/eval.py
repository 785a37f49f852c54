"""Evaluation command: ``dhm`` (d_HM between human and model score tables)."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _check_outputs, _fail, _json, _metric_list


def _read_tables(specs: tuple[str, ...], which: str):
    """``PATH`` (a score CSV) or ``METRIC=PATH`` (one score column or a JSON
    {story_id: score} file), merged into one table."""
    from storyrl.data import ScoreTable, StoryDataError, read_scores

    table = ScoreTable()
    for spec in specs:
        metric, sep, path = spec.partition("=")
        if not sep:
            metric, path = None, spec
        if not Path(path).is_file():
            _fail(f"--{which} {spec}: no such file {path}")
        try:
            table.merge(read_scores(path, metric), source=f"--{which} {spec}")
        except (StoryDataError, ValueError) as exc:
            _fail(str(exc))
    return table


@click.command()
@click.option("--human", multiple=True, required=True, help="Human score table: PATH or METRIC=PATH; repeatable.")
@click.option("--model", multiple=True, required=True, help="Model score table: PATH or METRIC=PATH; repeatable.")
@click.option("--metrics", default=None, help="Dimensions to use: any of groovist,coherence,repetition (default: all present).")
@click.option("--per-story", type=click.Path(dir_okay=False, path_type=Path), help="Write per-story distances to this CSV.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --per-story file.")
def dhm(human, model, metrics, per_story, overwrite) -> None:
    """d_HM between human and model stories; prints JSON
    {"n", <dimension distances>, "d_hm"} (null where no story counts, and then
    exits non-zero). groovist columns hold raw GROOViST scores (grounding uses
    their tanh)."""
    from storyrl.data import write_scores
    from storyrl.eval import dhm as compute_dhm

    if per_story is not None:
        inputs = [spec.partition("=")[2] or spec for spec in (*human, *model)]
        _check_outputs({"--per-story": per_story}, inputs, "keep" if overwrite else "refuse",
                       hint="use --overwrite to replace it")
    human_table = _read_tables(human, "human")
    model_table = _read_tables(model, "model")
    try:
        result = compute_dhm(human_table, model_table, _metric_list(metrics) or None)
    except ValueError as exc:
        _fail(str(exc))
    if result.n_excluded:
        click.echo(f"{result.n_excluded} stories left out: a selected score is missing or unscorable", err=True)
    click.echo(_json(result.summary()))
    if not result.n:
        _fail("no story has every selected score finite in both tables: d_HM is undefined")
    if per_story is not None:
        write_scores(per_story, result.story_ids, result.per_story, overwrite=overwrite)
