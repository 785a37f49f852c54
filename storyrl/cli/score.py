"""Scoring commands: ``score`` (stories -> score CSV), ``groovist-calibrate``
(θ for a dataset) and ``rewards`` (the registered rewards and their options)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from storyrl.cli.common import _FILE, _check_outputs, _fail, _metric_list
from storyrl.cli.config_options import GeneratedOptionsCommand, reward_options
from storyrl.cli.reward_options import (
    EPILOG,
    NOUNS_OPTION,
    attach_context_files,
    context_file_options,
    input_paths,
    make_rewards,
)


@click.command("rewards")
@click.argument("name", required=False)
def list_rewards_cmd(name) -> None:
    """List the registered rewards with a one-line description each, or
    NAME's options (type, default, description)."""
    from storyrl.rewards import REWARDS

    if name is None:
        width = max(map(len, REWARDS.names()))
        for reward in REWARDS.names():
            click.echo(f"{reward:<{width}}  {REWARDS.describe(reward)}")
        return
    from tabulate import tabulate

    from storyrl.config import REQUIRED, option_info

    try:
        cls = REWARDS.get(name)
    except KeyError as exc:
        _fail(exc.args[0])
    click.echo(f"{REWARDS.resolve(name)}: {REWARDS.describe(name)}")
    rows = [
        [info.name, str(info.type).replace("typing.", "").replace("<class '", "").replace("'>", ""),
         "(required)" if info.default is REQUIRED else repr(info.default),
         info.help + (f" One of: {', '.join(map(str, info.choices))}." if info.choices else "")]
        for info in option_info(cls.config_class)
    ]
    click.echo(tabulate(rows, headers=["option", "type", "default", "description"]))


def _ready(rewards, records=()) -> None:
    """Load every reward's models before anything is written. A reward that
    parses stories (spaCy) unless they carry their text units is told
    whether every record carries them."""
    for reward in rewards:
        fields = getattr(reward, "text_unit_fields", None)
        if fields and records:
            reward.text_units_given = all(any(getattr(r, f, None) is not None for f in fields) for r in records)
        reward.setup()


@click.command(cls=GeneratedOptionsCommand, generate=lambda own: reward_options(own=own), epilog=EPILOG)
@click.argument("stories", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--metrics", "-m", default="", help="Comma-separated reward names, e.g. repetition,groovist.")
@click.option(
    "--config",
    "configs",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reward config YAML (configs/rewards/*.yaml); repeatable.",
)
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Score CSV to write (*.csv).")
@click.option("--resume", is_flag=True, help="Keep the rows already in OUT and score only the missing stories.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT (and --explain file).")
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1),
              help="Stories per scoring batch (and per row write).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--explain", type=click.Path(dir_okay=False, path_type=Path), help="Write per-NP GROOViST details to this JSONL file.")
@context_file_options
@NOUNS_OPTION
def score(stories, metrics, configs, out, resume, overwrite, batch_size, quiet, explain, image_id_map, noun_phrase_map,
          noun_map, **reward_values) -> None:
    """Score the stories in STORIES (JSON {id: story} or JSONL records) and
    write OUT as CSV: story_id plus one column per metric (empty = unscorable).
    Rows are written as they are scored; --resume continues an interrupted run.
    OUT is locked while the command runs. Exits non-zero when a metric scored
    no story. Image-based metrics (groovist, clipscore) read each record's
    images or image_ids (or --image-ids); rovist_vg reads each record's
    nouns (or --nouns) when given, instead of parsing the story with spaCy."""
    from storyrl.data import ScoreWriter, load_stories, read_scores

    names = _metric_list(metrics)
    if not names and not configs:
        _fail("choose at least one metric (--metrics) or reward config (--config)")
    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other")
    if out.suffix.lower() != ".csv":
        _fail(f"--out {out}: score tables are CSV files; name it *.csv")
    inputs = [stories, *configs, image_id_map, noun_phrase_map, noun_map, *input_paths(reward_values)]
    _check_outputs({"--out": out, "--explain": explain}, inputs, "keep" if resume or overwrite else "refuse")

    rewards = make_rewards(names, configs, reward_values)
    explainer = next((r for r in rewards if hasattr(r, "explain")), None)
    if explain is not None and explainer is None:
        _fail("--explain needs a metric with per-phrase details (groovist)")
    columns = [r.name for r in rewards]
    if len(set(columns)) != len(columns):
        _fail(f"a metric is requested twice: {columns}")
    records = load_stories(stories)
    attach_context_files(records, image_id_map, noun_phrase_map, noun_map)
    _ready(rewards, records)

    with ScoreWriter(out, columns, resume=resume, overwrite=overwrite) as writer:
        todo = [r for r in records if r.story_id not in writer.done]
        if writer.done:
            click.echo(f"resuming {out}: {len(records) - len(todo)} of {len(records)} stories already scored", err=True)
        explain_file, explain_started = _open_explain(explain, writer.done, resume) if explain else (None, False)
        try:
            _score_batches(rewards, todo, batch_size, quiet, writer, explain_file, explainer)
        except BaseException:
            if explain_started and not writer.rows_written:
                explain_file.discard()  # as OUT is: nothing of this run is left to block a rerun
            raise
        finally:
            if explain_file is not None:
                explain_file.close()

    table = read_scores(out)
    scored = _print_summary(table, columns)
    for reward in rewards:
        for reason, count in reward.stats["reasons"].most_common():
            click.echo(f"{reward.name}: {count} unscorable: {reason}", err=True)
    empty = [m for m in columns if not scored[m]]
    if empty:
        _fail(f"no story could be scored for {', '.join(empty)} ({len(table.ids)} stories in {out})")


def _score_batches(rewards, todo, batch_size, quiet, writer, explain_file, explainer) -> None:
    from storyrl.eval.scoring import score_batches

    def explain(batch, texts, context) -> None:
        # Before the score rows: a story in OUT always has its explain
        # line (resume drops explain lines of stories not in OUT).
        lines = explainer.explain(texts, **context)
        explain_file.write("".join(
            json.dumps({"story_id": record.story_id, **details}) + "\n" for record, details in zip(batch, lines)
        ))

    score_batches(rewards, todo, writer, batch_size=batch_size, progress=not quiet,
                  before_write=explain if explain_file is not None else None)


def _open_explain(path: Path, done: set[str], resume: bool):
    """The --explain JSONL file, locked, and whether this run starts it; on
    resume it keeps exactly one line for each story already in OUT (a kill
    can leave lines of a batch whose scores were not written, or half a
    line)."""
    from storyrl.data import StoryDataError
    from storyrl.output_files import LockedOutput

    out = LockedOutput(path, "keep" if resume else "truncate")
    try:
        complete, partial = out.read()
        kept, seen = [], set()
        for lineno, line in enumerate(complete.splitlines(keepends=True), 1):
            try:
                sid = json.loads(line)["story_id"]
            except (ValueError, TypeError, KeyError):
                raise StoryDataError(path, "not an explain record (JSON object with story_id)", f"at line {lineno}") from None
            if sid in done and sid not in seen:
                kept.append(line)
                seen.add(sid)
        text = "".join(kept)
        if partial or text != complete:
            out.replace(text)
    except BaseException:
        out.close()
        raise
    return out, not text


def _context(batch) -> dict:
    """Per-story context columns that any record of the batch carries."""
    from storyrl.eval.scoring import score_context

    return score_context(batch)


def _print_summary(table, columns) -> dict[str, int]:
    """Print stories / scored / unscorable / mean per metric; returns the
    number of scored stories per metric."""
    from tabulate import tabulate

    rows, scored = [], {}
    for metric in columns:
        values = [table.scores[metric][sid] for sid in table.ids]
        finite = [v for v in values if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else math.nan
        rows.append([metric, len(values), len(finite), len(values) - len(finite), mean])
        scored[metric] = len(finite)
    click.echo(tabulate(rows, headers=["metric", "stories", "scored", "unscorable", "mean"], floatfmt=".4f"))
    return scored


# Every reward's options, as score has: the same command lines keep working
# (only groovist's options matter here).
@click.command("groovist-calibrate", cls=GeneratedOptionsCommand,
               generate=lambda own: reward_options(own=own), epilog=EPILOG)
@click.argument("stories", type=_FILE)
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@context_file_options
def groovist_calibrate(stories, batch_size, quiet, image_id_map, noun_phrase_map, **reward_values) -> None:
    """θ for a dataset: the mean NP score (2.5 x best CLIP cosine) over all
    noun phrases of the stories in STORIES (with their images). Prints JSON;
    pass the value to --theta or a config's theta."""
    from storyrl.data import StoryDataError, load_stories
    from storyrl.rewards.groovist import calibrate_theta

    (reward,) = make_rewards(["groovist"], (), reward_values)
    try:
        records = load_stories(stories)
    except StoryDataError as exc:
        _fail(str(exc))
    attach_context_files(records, image_id_map, noun_phrase_map)
    try:  # models, spaCy and the hub are checked before any work, as score does
        _ready([reward], records)
    except ValueError as exc:
        _fail(str(exc))
    context = _context(records)
    from storyrl.console import progress as progress_bar

    try:
        with progress_bar(total=len(records), unit="story", disable=quiet, file=sys.stderr) as bar:
            texts = [r.story for r in records]
            result = calibrate_theta(reward, texts, batch_size=batch_size, progress=bar.update, **context)
    except ValueError as exc:
        _fail(str(exc))
    click.echo(json.dumps(result))
