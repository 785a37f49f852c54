"""``storyrl compare``: storytellers side by side against the human stories
(:mod:`storyrl.eval.compare`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from storyrl.cli.common import _check_outputs, _fail, _finite, _json, _metric_list

_PATH = click.Path(exists=True, dir_okay=False)


def _table(paths: list[str], what: str):
    from storyrl.data import ScoreTable, StoryDataError, read_scores

    table = ScoreTable()
    for path in paths:
        try:
            table.merge(read_scores(path), source=f"{what} {path}")
        except (StoryDataError, ValueError) as exc:
            _fail(str(exc))
    return table


@click.command("compare")
@click.option("--human", nargs=2, type=_PATH, required=True, metavar="STORIES SCORES",
              help="The human stories (records, VIST SIS JSON, ...) and their score CSV (storyrl score).")
@click.option("--system", "systems", nargs=3, multiple=True, required=True, metavar="NAME STORIES SCORES",
              type=(str, _PATH, _PATH),
              help="A storyteller: its name, its story file (storyrl generate) and its score CSV; repeatable, "
                   "in table order.")
@click.option("--scores", "extra", nargs=2, multiple=True, type=(str, _PATH), metavar="NAME CSV",
              help="More score columns for system NAME (e.g. `storyrl kl`'s kl column); repeatable.")
@click.option("--baseline", default=None,
              help="The system the paired differences are against (default: the first --system).")
@click.option("--metrics", default=None,
              help="d_HM score columns: any of groovist,coherence,repetition (default: those every table has).")
@click.option("--resamples", type=click.IntRange(min=1), default=2000, show_default=True,
              help="Bootstrap resamples of the story ids.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Bootstrap seed.")
@click.option("--level", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=0.95,
              show_default=True, help="Confidence level of the intervals.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Markdown tables to write (*.md).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every figure as JSON (*.json).")
@click.option("--overwrite", is_flag=True, help="Replace existing output files.")
def compare(human, systems, extra, baseline, metrics, resamples, seed, level, out, json_out, overwrite) -> None:
    """Compare storytellers on the same image sequences: per system d_HM and
    each dimension's distance to the human stories, the paired difference to
    the baseline system with a bootstrap interval over the story ids, the
    mean of each score column (metrics, and extra ones such as KL to the
    start policy), and story length and distinct-n. Writes Markdown tables
    (and JSON); prints a JSON summary line."""
    from storyrl.data import StoryDataError, load_stories
    from storyrl.datasets import load_records
    from storyrl.eval.compare import compare_systems, comparison_markdown
    from storyrl.output_files import OutputError, replace_file

    if out.suffix.lower() != ".md":
        _fail(f"--out {out}: the tables are Markdown; name it *.md", exit_code=2)
    if json_out is not None and json_out.suffix.lower() != ".json":
        _fail(f"--json {json_out}: name it *.json", exit_code=2)
    names = [name for name, _, _ in systems]
    for k, name in enumerate(names):
        if not name.strip() or name != name.strip() or "|" in name:
            _fail(f"--system {name!r}: a name must be non-empty text without '|' or surrounding spaces", exit_code=2)
        if name in names[:k]:
            _fail(f"--system {name}: given twice", exit_code=2)
    for name, _ in extra:
        if name not in names:
            _fail(f"--scores {name}: no --system of that name ({', '.join(names)})", exit_code=2)
    baseline = names[0] if baseline is None else baseline
    if baseline not in names:
        _fail(f"--baseline {baseline}: no --system of that name ({', '.join(names)})", exit_code=2)
    inputs = [*human, *(p for _, s, c in systems for p in (s, c)), *(c for _, c in extra)]
    _check_outputs({"--out": out, "--json": json_out}, inputs, "keep" if overwrite else "refuse",
                   hint="use --overwrite to replace it")
    try:
        human_stories = [r.story for r in load_records(human[0])]
        tables = {}
        for name, stories_path, scores_path in systems:
            stories = {r.story_id: r.story for r in load_stories(stories_path)}
            tables[name] = (_table([scores_path, *(c for n, c in extra if n == name)], f"--system {name}"), stories)
    except (StoryDataError, ValueError) as exc:
        _fail(str(exc))
    human_table = _table([human[1]], "--human")
    try:
        result = compare_systems(human_table, human_stories, tables, baseline=baseline,
                                 metrics=_metric_list(metrics) or None, resamples=resamples, seed=seed, level=level)
    except ValueError as exc:
        _fail(str(exc))
    try:
        replace_file(out, comparison_markdown(result), overwrite=overwrite)
        if json_out is not None:
            replace_file(json_out, json.dumps(_finite(result.to_json()), indent=1) + "\n", overwrite=overwrite)
    except OutputError as exc:
        _fail(str(exc))
    click.echo(_json({"out": str(out), "baseline": baseline,
                      **{s.name: s.d_hm for s in result.systems}}))
    if not any(s.n for s in result.systems):
        _fail("no system has a story d_HM can count (every selected score finite for it and its human story)")

