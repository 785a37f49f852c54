"""``storyrl meta-eval``: metrics against human judgements.

``pairs`` (VHED CSV, VIST-Edit folder or JSONL pairs → pair accuracy per
subset), ``ratings`` (a ratings CSV + the rated stories → correlations per
aspect) and ``original-vs-random`` (GROOViST's criterion 1). Metrics are
reward names and ``FILE.csv:column`` precomputed score columns (``-m``),
reward configs (``--config``) and whole score tables (``--scores``). Each
writes ``--out TABLE.csv`` with ``TABLE.md`` and ``TABLE.png`` beside it; the
library side is :mod:`storyrl.eval.meta_eval`.
"""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _check_outputs, _fail, _metric_list
from storyrl.cli.config_options import GeneratedOptionsCommand, reward_options
from storyrl.cli.reward_options import EPILOG, attach_context_files, context_file_options, input_paths, make_rewards

_OUT = click.Path(dir_okay=False, path_type=Path)


def _command(name: str):
    return click.command(name, cls=GeneratedOptionsCommand, generate=lambda own: reward_options(own=own),
                         epilog=EPILOG)


def _metric_options(function):
    for option in reversed([
        click.option("--metrics", "-m", default="",
                     help="Comma-separated reward names and precomputed columns FILE.csv:COLUMN."),
        click.option("--config", "configs", multiple=True, type=_FILE, help="Reward config YAML; repeatable."),
        click.option("--scores", "score_files", multiple=True, type=_FILE,
                     help="Score table (story_id + columns): every column is a metric; repeatable."),
        click.option("--out", "-o", required=True, type=_OUT,
                     help="Table to write (*.csv); TABLE.md and TABLE.png are written beside it."),
        click.option("--overwrite", is_flag=True, help="Replace existing output files."),
        click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1),
                     help="Stories per scoring batch."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bars."),
    ]):
        function = option(function)
    return function


def _floats(value: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in _metric_list(value)]
    except ValueError:
        _fail(f"{flag} {value!r}: expected comma-separated numbers")


def _prepare(out: Path, overwrite: bool, inputs: list) -> None:
    from storyrl.eval.meta_eval_report import report_paths

    if out.suffix.lower() != ".csv":
        _fail(f"--out {out}: the table is a CSV file; name it *.csv")
    paths = report_paths(out)
    _check_outputs({"--out": out, "--out (.md)": paths["markdown"], "--out (.png)": paths["plot"]},
                   inputs, "keep" if overwrite else "refuse", hint="use --overwrite to replace it")


def _metrics(metrics: str, configs, score_files, reward_values) -> list:
    """Rewards and precomputed columns as :class:`~storyrl.eval.meta_eval.Metric`."""
    from storyrl.data import StoryDataError, read_scores
    from storyrl.eval.meta_eval import Metric

    names, found = [], []
    for item in _metric_list(metrics):
        path, sep, column = item.rpartition(":")
        if sep and Path(path).is_file():
            try:
                table = read_scores(path, require=[column])
            except (StoryDataError, ValueError) as exc:
                _fail(str(exc))
            found.append(Metric(name=column, scores=table.scores[column]))
        else:
            names.append(item)
    for path in score_files:
        try:
            table = read_scores(path)
        except StoryDataError as exc:
            _fail(str(exc))
        found += [Metric(name=m, scores=table.scores[m]) for m in table.metrics]
    if names or configs:
        found = [Metric(name=r.name, reward=r) for r in make_rewards(names, configs, reward_values)] + found
    if not found:
        _fail("choose at least one metric (--metrics, --config or --scores)")
    seen = [m.name for m in found]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        _fail(f"metric {twice[0]!r} is given twice")
    return found


def _finish(kind: str, result, out: Path, headers, overwrite: bool, title: str, notes: list[str]) -> None:
    from storyrl.eval.meta_eval_report import write_report

    for name, count in result.unscorable.items():
        if count:
            notes.append(f"{name}: {count} unscorable (NaN) — " +
                         ("counted as wrong" if kind == "pairs" else "left out"))
    for note in result.notes:  # warnings of the table itself (e.g. too few systems)
        notes.append(note)
        click.echo(note, err=True)
    for name, reason in result.failed.items():
        notes.append(f"{name}: failed: {reason}")
        click.echo(f"{name}: failed: {reason}", err=True)
    if result.all_failed:
        _fail("every metric failed; nothing written")
    paths, markdown = write_report(kind, out, headers, result.rows, notes, title, overwrite)
    click.echo(markdown)
    click.echo(f"wrote {paths['csv']}, {paths['markdown']}, {paths['plot']}", err=True)


@click.group("meta-eval")
def meta_eval() -> None:
    """Meta-evaluate metrics against human judgements: pair accuracy
    (pairs), correlation with ratings (ratings), GROOViST's original vs
    random (original-vs-random)."""


@_command("pairs")
@click.option("--vhed", type=_FILE, help="VHED-format CSV of ranked story pairs.")
@click.option("--vist-edit", "vist_edit", type=_DIR, help="VIST-Edit root (AREL/ and GLAC/ with train/dev/test/*.json).")
@click.option("--pairs", "pairs_file", type=_FILE, help="JSONL preference pairs (better, worse, subsets, ...).")
@_metric_options
@click.option("--references", "references_file", type=_FILE,
              help="VHED: JSON {img_seq or story_id: [reference stories]} added to the file's references.")
@click.option("--reference-models", default="", help="VHED: model names of reference stories (comma-separated; "
              "default reference,ref,human,gt,ground_truth,groundtruth,gold).")
@click.option("--gap-edges", default="0.1,0.2,0.3", show_default=True, help="VHED: |gap| bucket edges.")
@click.option("--bucket-agreements", default="4,5", show_default=True,
              help="VHED: agreements whose pairs are bucketed by gap.")
@click.option("--gap-column", type=click.Choice(["label", "rank_norm"]), default="label", show_default=True,
              help="VHED: the gap the buckets use.")
def pairs(vhed, vist_edit, pairs_file, metrics, configs, score_files, out, overwrite, batch_size, quiet,
          references_file, reference_models, gap_edges, bucket_agreements, gap_column, **reward_values) -> None:
    """Pair accuracy per subset (ties and NaN count as wrong; n = all pairs
    of the subset) of every metric, on exactly one of --vhed, --vist-edit
    or --pairs."""
    import json

    from storyrl.eval.meta_eval import PAIR_COLUMNS, pairs_table
    from storyrl.judgements import JudgementDataError

    sources = [s for s in (vhed, vist_edit, pairs_file) if s is not None]
    if len(sources) != 1:
        _fail("give exactly one of --vhed, --vist-edit, --pairs")
    if references_file is not None and vhed is None:
        _fail("--references is for --vhed")
    edges = _floats(gap_edges, "--gap-edges")
    agreements = [int(a) for a in _floats(bucket_agreements, "--bucket-agreements")]
    _prepare(out, overwrite, [*sources, *configs, *score_files, references_file, *input_paths(reward_values)])
    found = _metrics(metrics, configs, score_files, reward_values)
    notes: list[str] = []
    try:
        if vhed is not None:
            from storyrl.judgements.pairs import vhed_pairs
            from storyrl.judgements.vhed import DEFAULT_REFERENCE_MODELS, load_vhed

            refs = None
            if references_file is not None:
                try:
                    refs = json.loads(references_file.read_text(encoding="utf-8"))
                except json.JSONDecodeError as exc:
                    _fail(f"{references_file}: invalid JSON at line {exc.lineno}: {exc.msg}")
                if not isinstance(refs, dict) or not all(
                        isinstance(v, list) and all(isinstance(s, str) for s in v) for v in refs.values()):
                    _fail(f"{references_file}: expected a JSON object {{img_seq or story_id: [stories]}}")
            data = load_vhed(vhed)
            pair_list = vhed_pairs(data, references=refs, gap_edges=edges, bucket_agreements=agreements,
                                   gap_column=gap_column,
                                   reference_models=_metric_list(reference_models) or DEFAULT_REFERENCE_MODELS)
            notes.append(f"{vhed}: {data.rows} rows, {data.zero_gap_dropped} zero-gap pairs dropped; "
                         f"gap buckets on |{gap_column}| over agreements {agreements}, edges {edges} (right-closed)")
        elif vist_edit is not None:
            from storyrl.judgements.vist_edit import load_vist_edit, vist_edit_pairs

            data = load_vist_edit(vist_edit)
            pair_list = vist_edit_pairs(data)
            notes.append(f"{vist_edit}: {len(data.stories)} machine stories, {len(pair_list)} edits; "
                         f"{data.identical} edits identical to their machine story (kept: a tie, wrong for every metric)")
        else:
            from storyrl.judgements.pairs import load_pairs_jsonl

            pair_list = load_pairs_jsonl(pairs_file)
    except (JudgementDataError, ValueError, OSError) as exc:
        _fail(" ".join(str(exc).split()))
    if not pair_list:
        _fail("no pairs to evaluate")
    result = pairs_table(pair_list, found, batch_size=batch_size, progress=not quiet, gap_edges=edges)
    _finish("pairs", result, out, PAIR_COLUMNS, overwrite, "Pair accuracy", notes)


@_command("ratings")
@click.argument("ratings_file", metavar="RATINGS", type=_FILE)
@click.option("--stories", required=True, type=_FILE, help="The rated stories (any story file; ids = the ratings' story ids).")
@click.option("--where", multiple=True, help="Keep rows whose COLUMN=VALUE (e.g. team=auto-gen); repeatable.")
@click.option("--story-column", default="story_id", show_default=True)
@click.option("--rater-column", default="workerId", show_default=True)
@click.option("--aspects", default="focused,coherent,share,human,grounded,detailed", show_default=True,
              help="Comma-separated aspect (rating) columns.")
@click.option("--system-column", default=None, help="Column naming each story's system: adds system-level τ.")
@click.option("--n-boot", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Bootstrap resamples for the Kendall τ-b interval.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--level", default=0.95, show_default=True, type=click.FloatRange(0, 1, min_open=True, max_open=True))
@_metric_options
@context_file_options
def ratings(ratings_file, stories, where, story_column, rater_column, aspects, system_column, n_boot, seed, level,
            metrics, configs, score_files, out, overwrite, batch_size, quiet, image_id_map, noun_phrase_map,
            **reward_values) -> None:
    """Story-level Kendall τ-b, Spearman and Pearson (each story's mean
    rating over its raters against its score; bootstrap CI of τ-b) per
    aspect, and system-level correlations with --system-column."""
    from storyrl.data import StoryDataError, load_stories
    from storyrl.eval.meta_eval import RATING_COLUMNS, ratings_table
    from storyrl.judgements import JudgementDataError
    from storyrl.judgements.ratings import load_ratings, parse_where

    _prepare(out, overwrite, [ratings_file, stories, *configs, *score_files, image_id_map, noun_phrase_map,
                              *input_paths(reward_values)])
    found = _metrics(metrics, configs, score_files, reward_values)
    try:
        table = load_ratings(ratings_file, story_column=story_column, rater_column=rater_column,
                             aspects=_metric_list(aspects), system_column=system_column, where=parse_where(where))
        records = load_stories(stories)
    except (JudgementDataError, StoryDataError, ValueError) as exc:
        _fail(" ".join(str(exc).split()))
    attach_context_files(records, image_id_map, noun_phrase_map)
    by_id = {r.story_id: r for r in records}
    try:
        result = ratings_table(table, by_id, found, n_boot=n_boot, seed=seed, level=level, batch_size=batch_size,
                               progress=not quiet)
    except ValueError as exc:
        _fail(f"{stories}: {exc}")
    notes = [f"{ratings_file}: {table.kept} of {table.rows} rows kept"
             + (f" ({', '.join(where)})" if where else "") + f", {len(table.story_ids)} stories; "
             f"CI: {level:g} percentile bootstrap of Kendall τ-b over stories ({n_boot} resamples, seed {seed})"]
    _finish("ratings", result, out, RATING_COLUMNS, overwrite, "Correlation with ratings", notes)


@_command("original-vs-random")
@click.argument("stories", type=_FILE)
@click.option("-k", "k", default=5, show_default=True, type=click.IntRange(min=1), help="Random stories per sequence.")
@click.option("--seed", default=0, show_default=True, type=int)
@_metric_options
@context_file_options
def original_vs_random(stories, k, seed, metrics, configs, score_files, out, overwrite, batch_size, quiet,
                       image_id_map, noun_phrase_map, **reward_values) -> None:
    """GROOViST criterion 1: per metric, the mean over sequences of the
    original story's score minus the best of k random other stories' scores
    on the same images (with each record's images or image_ids)."""
    from storyrl.data import StoryDataError, load_stories
    from storyrl.eval.meta_eval import OVR_COLUMNS, original_vs_random_table

    _prepare(out, overwrite, [stories, *configs, *score_files, image_id_map, noun_phrase_map,
                              *input_paths(reward_values)])
    found = _metrics(metrics, configs, score_files, reward_values)
    try:
        records = load_stories(stories)
    except StoryDataError as exc:
        _fail(str(exc))
    attach_context_files(records, image_id_map, noun_phrase_map)
    if len(records) < 2:
        _fail(f"{stories}: criterion 1 needs at least 2 stories")
    result = original_vs_random_table(records, found, k=k, seed=seed, batch_size=batch_size)
    _finish("original-vs-random", result, out, OVR_COLUMNS, overwrite, "Original vs random (GROOViST criterion 1)",
            [f"k = {k} random stories per sequence, seed {seed}"])


for _sub in (pairs, ratings, original_vs_random):
    meta_eval.add_command(_sub)
