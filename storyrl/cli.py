"""The ``storyrl`` command line: a thin layer over the library.

Heavy libraries are imported inside the commands that need them, so
``storyrl --help`` and model-free scoring start fast.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click


def _fail(message: str) -> None:
    raise click.ClickException(message)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="storyrl")
def main() -> None:
    """storyrl: visual-storytelling metrics as rewards, scores and d_HM tables."""


@main.command("rewards")
def list_rewards_cmd() -> None:
    """List the registered rewards."""
    from storyrl.rewards import list_rewards

    for name in list_rewards():
        click.echo(name)


def _metric_list(value: str | None) -> list[str]:
    return [m.strip() for m in (value or "").split(",") if m.strip()]


@main.command()
@click.argument("stories", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--metrics", "-m", default="", help="Comma-separated reward names, e.g. repetition.")
@click.option(
    "--config",
    "configs",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reward config YAML (configs/rewards/*.yaml); repeatable.",
)
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Score CSV to write.")
@click.option("--resume", is_flag=True, help="Keep the rows already in OUT and score only the missing stories.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT.")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def score(stories, metrics, configs, out, resume, overwrite, batch_size, quiet) -> None:
    """Score the stories in STORIES (JSON {id: story} or JSONL records) and
    write OUT as CSV: story_id plus one column per metric (empty = unscorable).
    Rows are written as they are scored; --resume continues an interrupted run."""
    from storyrl.data import ScoreWriter, StoryDataError, load_stories, read_scores
    from storyrl.rewards import create_reward, load_reward_config

    names = _metric_list(metrics)
    if not names and not configs:
        _fail("choose at least one metric (--metrics) or reward config (--config)")
    try:
        rewards = [load_reward_config(c) for c in configs] + [create_reward(n) for n in names]
    except (KeyError, TypeError, ValueError) as exc:
        _fail(str(exc.args[0] if isinstance(exc, KeyError) else exc))
    columns = [r.name for r in rewards]
    if len(set(columns)) != len(columns):
        _fail(f"a metric is requested twice: {columns}")
    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other")
    if out.exists() and out.stat().st_size and not (resume or overwrite):
        _fail(f"{out} exists: use --resume to continue it or --overwrite to replace it")
    try:
        records = load_stories(stories)
        out.parent.mkdir(parents=True, exist_ok=True)
        writer = ScoreWriter(out, columns, append=resume)
    except StoryDataError as exc:
        _fail(str(exc))
    todo = [r for r in records if r.story_id not in writer.done]
    if writer.done:
        click.echo(f"resuming {out}: {len(records) - len(todo)} of {len(records)} stories already scored", err=True)

    from tqdm import tqdm

    with writer, tqdm(total=len(todo), unit="story", disable=quiet, file=sys.stderr) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            context = _context(batch)
            texts = [r.story for r in batch]
            scores = {r.name: r.score(texts, **context) for r in rewards}
            writer.write([r.story_id for r in batch], scores)
            bar.update(len(batch))

    table = read_scores(out)
    _print_summary(table, columns)


def _context(batch) -> dict:
    """Per-story context columns that any record of the batch carries."""
    context = {}
    for key in ("images", "image_ids", "reference"):
        values = [getattr(r, key) for r in batch]
        if any(v is not None for v in values):
            context[key] = values
    return context


def _print_summary(table, columns) -> None:
    from tabulate import tabulate

    rows = []
    for metric in columns:
        values = [table.scores[metric][sid] for sid in table.ids]
        finite = [v for v in values if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else math.nan
        rows.append([metric, len(values), len(finite), len(values) - len(finite), mean])
    click.echo(tabulate(rows, headers=["metric", "stories", "scored", "unscorable", "mean"], floatfmt=".4f"))


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


@main.command()
@click.option("--human", multiple=True, required=True, help="Human score table: PATH or METRIC=PATH; repeatable.")
@click.option("--model", multiple=True, required=True, help="Model score table: PATH or METRIC=PATH; repeatable.")
@click.option("--metrics", default=None, help="Dimensions to use: any of groovist,coherence,repetition (default: all present).")
@click.option("--per-story", type=click.Path(dir_okay=False, path_type=Path), help="Write per-story distances to this CSV.")
def dhm(human, model, metrics, per_story) -> None:
    """d_HM between human and model stories; prints JSON
    {"n", <dimension distances>, "d_hm"}. groovist columns hold raw GROOViST
    scores (grounding uses their tanh)."""
    from storyrl.data import write_scores
    from storyrl.eval import dhm as compute_dhm

    human_table = _read_tables(human, "human")
    model_table = _read_tables(model, "model")
    try:
        result = compute_dhm(human_table, model_table, _metric_list(metrics) or None)
    except ValueError as exc:
        _fail(str(exc))
    if result.n_excluded:
        click.echo(f"{result.n_excluded} stories left out: a selected score is missing or unscorable", err=True)
    if per_story is not None:
        write_scores(per_story, result.story_ids, result.per_story)
    click.echo(json.dumps(result.summary()))


if __name__ == "__main__":
    main()
