"""The ``storyrl`` command line: a thin layer over the library.

Heavy libraries are imported inside the commands that need them, so
``storyrl --help`` and model-free scoring start fast.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import click


class CommandError(click.ClickException):
    """A one-line error ending the command with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _fail(message: str, exit_code: int = 1) -> None:
    raise CommandError(message, exit_code)


def _debug() -> bool:
    return os.environ.get("STORYRL_DEBUG", "") not in ("", "0")


# Errors whose message already says which file, record, reward or option is at
# fault; anything else is shown with its type.
_EXPECTED_ERRORS = ("StoryDataError", "OutputError", "RewardError", "ConfigFileError", "ImageError",
                    "PipelineNotInstalled")


def describe_error(exc: BaseException) -> str:
    """One line for an exception: the file and the fault for OS errors, the
    message for storyrl's own errors, type and message otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        message = f"{where}{exc.strerror}"
    else:
        message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (OSError, ValueError, KeyError)) and type(exc).__name__ not in _EXPECTED_ERRORS:
        message = f"{type(exc).__name__}: {message}"
    return message


class _Group(click.Group):
    """Turns every error of a command into one line on stderr and a non-zero
    exit (130 for Ctrl-C); ``STORYRL_DEBUG=1`` or ``--debug`` adds the
    traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            if _debug():
                import traceback

                traceback.print_exc()
            if isinstance(exc, KeyboardInterrupt):
                raise CommandError("interrupted", exit_code=130) from None
            raise CommandError(describe_error(exc)) from exc


def _set_debug(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        os.environ["STORYRL_DEBUG"] = "1"  # also for the subprocesses a command starts
    return value


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="storyrl")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show tracebacks (same as STORYRL_DEBUG=1).")
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


_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
_DIR = click.Path(exists=True, file_okay=False, path_type=Path)

# Options of the image-based rewards; each reaches the rewards that accept it.
_REWARD_OPTIONS = [
    click.option("--image-root", type=_DIR, help="Directory that image paths and image ids are resolved against."),
    click.option("--image-ids", "image_id_map", type=_FILE, help="JSON {story_id: [image ids]} for story sets without images."),
    click.option("--regions", type=click.Choice(["table", "crops", "grid", "whole"]), help="Region source (groovist)."),
    click.option("--region-table", type=_FILE, help="Region table CSV (image_id,bbox rows; top-B per image in file order)."),
    click.option("--crops-dir", type=_DIR, help="Directory of precomputed crops named <image_id>_<bbox>.jpg."),
    click.option("--top-b", type=click.IntRange(min=1), help="Regions per image (default 10)."),
    click.option("--clip-model", help="open_clip model name, hf-hub:org/repo or local-dir:PATH (default ViT-B-32)."),
    click.option("--clip-pretrained", help="open_clip pretrained tag or local checkpoint (default openai)."),
    click.option("--device", help="cuda, cpu, ... (default: CUDA when available)."),
    click.option("--precision", type=click.Choice(["auto", "fp32", "fp16", "bf16"])),
    click.option("--theta", help="GROOViST θ: a number or vist, aesop, vwp, custom."),
    click.option("--spacy-pipeline", help="spaCy pipeline for noun phrases (default en_core_web_trf)."),
    click.option("--noun-phrases", "noun_phrase_map", type=_FILE, help="Precomputed NPs, JSON {story_id: [phrases]} (skips spaCy)."),
    click.option("--concreteness", type=_FILE, help="Concreteness ratings file (default: storyrl asset cache)."),
    click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), help="On-disk region-embedding cache."),
    click.option("--coherence-model", type=click.Path(exists=True, path_type=Path), help="RoViST-C model: storyrl directory or the authors' checkpoint."),
    click.option("--trust-checkpoint/--no-trust-checkpoint", default=None, help="Allow unpickling the authors' RoViST-C checkpoint (only for files you trust)."),
    click.option("--mode", type=click.Choice(["prefix", "adjacent"]), help="Coherence pairs: prefix (d_HM, default) or adjacent (RoViST)."),
    click.option("--rovist-vg-model", type=click.Path(exists=True, file_okay=False, path_type=Path), help="RoViST-VG model directory (storyrl train rovist-vg)."),
    click.option("--glove", type=_FILE, help="GloVe word vectors, text format (rovist_vg)."),
    click.option("--idf-corpus", type=_FILE, help="Story set whose word document frequencies give idf weights."),
]
# CLI option -> (reward, constructor argument) where the name alone would be ambiguous.
_RENAMED_OPTIONS = {"coherence_model": ("coherence", "model"), "rovist_vg_model": ("rovist_vg", "model")}


def _reward_options(function):
    for option in reversed(_REWARD_OPTIONS):
        function = option(function)
    return function


def _option_values(kwargs: dict) -> tuple[dict, dict]:
    """Split command kwargs into reward options and story-context files."""
    context_files = {"image_ids": kwargs.pop("image_id_map"), "noun_phrases": kwargs.pop("noun_phrase_map")}
    options = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items() if v is not None}
    return options, context_files


def _make_rewards(names: list[str], configs, options: dict) -> list:
    from storyrl.rewards import accepted_options, create_reward, get_reward_class, load_reward_config

    def options_for(name: str) -> dict:
        own = {k: v for k, v in options.items() if k not in _RENAMED_OPTIONS}
        own.update({arg: options[k] for k, (reward, arg) in _RENAMED_OPTIONS.items() if reward == name and k in options})
        return own

    try:
        rewards = [load_reward_config(c, overrides=options_for(_config_reward_name(c))) for c in configs]
        for name in names:
            allowed = accepted_options(get_reward_class(name))
            rewards.append(create_reward(name, **{k: v for k, v in options_for(name).items() if k in allowed}))
    except (KeyError, TypeError, ValueError) as exc:
        _fail(str(exc.args[0] if isinstance(exc, KeyError) else exc))
    return rewards


def _config_reward_name(path: Path) -> str | None:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None  # load_reward_config reports it
    return data.get("reward") if isinstance(data, dict) else None


def _attach_context_files(records, files: dict) -> None:
    """Fill records' image ids / noun phrases from ``--image-ids`` / ``--noun-phrases``."""
    from storyrl.data import StoryDataError, load_id_lists

    for key, path in files.items():
        if path is None:
            continue
        try:
            table = load_id_lists(path, "image ids" if key == "image_ids" else "phrases")
        except StoryDataError as exc:
            _fail(str(exc))
        missing = [r.story_id for r in records if r.story_id not in table]
        if missing:
            _fail(f"{path}: no entry for story {missing[0]!r} ({len(missing)} stories missing)")
        for r in records:
            setattr(r, key, table[r.story_id])


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b) or a.resolve() == b.resolve()
    except OSError:
        return False


def _check_outputs(
    outputs: dict[str, Path | None], inputs: list, existing: str,
    hint: str = "use --resume to continue it or --overwrite to replace it",
) -> None:
    """Before any work: no output is an input or another output, none is
    locked by another writer, unwritable, or (without --resume/--overwrite)
    already there."""
    from storyrl.output_files import OutputExistsError, check_output

    named = [(flag, path) for flag, path in outputs.items() if path is not None]
    for k, (flag, path) in enumerate(named):
        for source in inputs:
            if source is not None and _same_file(path, Path(source)):
                _fail(f"{flag} {path} is also an input file; it would be destroyed: write elsewhere")
        for other_flag, other in named[:k]:
            if _same_file(path, other):
                _fail(f"{flag} and {other_flag} are the same file {path}")
        try:
            check_output(path, existing)
        except OutputExistsError:
            _fail(f"{path} exists: {hint}")


def _ready(rewards) -> None:
    """Load every reward's models before anything is written."""
    for reward in rewards:
        reward.setup()


@main.command()
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
@click.option("--batch-size", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--explain", type=click.Path(dir_okay=False, path_type=Path), help="Write per-NP GROOViST details to this JSONL file.")
@_reward_options
def score(stories, metrics, configs, out, resume, overwrite, batch_size, quiet, explain, **reward_kwargs) -> None:
    """Score the stories in STORIES (JSON {id: story} or JSONL records) and
    write OUT as CSV: story_id plus one column per metric (empty = unscorable).
    Rows are written as they are scored; --resume continues an interrupted run.
    OUT is locked while the command runs. Exits non-zero when a metric scored
    no story. Image-based metrics (groovist, clipscore) read each record's
    images or image_ids (or --image-ids)."""
    from storyrl.data import ScoreWriter, load_stories, read_scores

    names = _metric_list(metrics)
    if not names and not configs:
        _fail("choose at least one metric (--metrics) or reward config (--config)")
    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other")
    if out.suffix.lower() != ".csv":
        _fail(f"--out {out}: score tables are CSV files; name it *.csv")
    inputs = [stories, *configs, *(v for v in reward_kwargs.values() if isinstance(v, Path))]
    _check_outputs({"--out": out, "--explain": explain}, inputs, "keep" if resume or overwrite else "refuse")

    options, context_files = _option_values(reward_kwargs)
    rewards = _make_rewards(names, configs, options)
    explainer = next((r for r in rewards if hasattr(r, "explain")), None)
    if explain is not None and explainer is None:
        _fail("--explain needs a metric with per-phrase details (groovist)")
    columns = [r.name for r in rewards]
    if len(set(columns)) != len(columns):
        _fail(f"a metric is requested twice: {columns}")
    records = load_stories(stories)
    _attach_context_files(records, context_files)
    _ready(rewards)

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
    from tqdm import tqdm

    with tqdm(total=len(todo), unit="story", disable=quiet, file=sys.stderr) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            context = _context(batch)
            texts = [r.story for r in batch]
            scores = {r.name: r.score(texts, **context) for r in rewards}
            if explain_file is not None:
                # Before the score rows: a story in OUT always has its explain
                # line (resume drops explain lines of stories not in OUT).
                lines = explainer.explain(texts, **context)
                explain_file.write("".join(
                    json.dumps({"story_id": record.story_id, **details}) + "\n" for record, details in zip(batch, lines)
                ))
            writer.write([r.story_id for r in batch], scores)
            bar.update(len(batch))


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
    context = {}
    for key in ("images", "image_ids", "reference", "noun_phrases"):
        values = [getattr(r, key) for r in batch]
        if any(v is not None for v in values):
            context[key] = values
    return context


def _json(summary: dict) -> str:
    """One JSON line; NaN and infinities (not JSON) become null."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()})


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


@main.command("groovist-calibrate")
@click.argument("stories", type=_FILE)
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_reward_options
def groovist_calibrate(stories, batch_size, quiet, **reward_kwargs) -> None:
    """θ for a dataset: the mean NP score (2.5 x best CLIP cosine) over all
    noun phrases of the stories in STORIES (with their images). Prints JSON;
    pass the value to --theta or a config's theta."""
    from storyrl.data import StoryDataError, load_stories
    from storyrl.rewards.groovist import calibrate_theta

    options, context_files = _option_values(reward_kwargs)
    (reward,) = _make_rewards(["groovist"], (), options)
    try:
        records = load_stories(stories)
    except StoryDataError as exc:
        _fail(str(exc))
    _attach_context_files(records, context_files)
    context = _context(records)
    from tqdm import tqdm

    try:
        with tqdm(total=len(records), unit="story", disable=quiet, file=sys.stderr) as bar:
            texts = [r.story for r in records]
            result = calibrate_theta(reward, texts, batch_size=batch_size, progress=bar.update, **context)
    except ValueError as exc:
        _fail(str(exc))
    click.echo(json.dumps(result))


@main.command()
@click.argument("images", nargs=-1, type=_FILE)
@click.option("--image-dir", type=_DIR, help="Detect regions in every image of this directory.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Region table CSV to write (resumes if it exists).")
@click.option("--weights", type=_FILE, help="Faster R-CNN weights (default: torchvision's cached COCO checkpoint).")
@click.option("--top-b", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--score-threshold", default=0.0, show_default=True, type=float)
@click.option("--device", default=None)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def regions(images, image_dir, out, weights, top_b, score_threshold, device, quiet) -> None:
    """Detect object regions with torchvision's Faster R-CNN and write a region
    table (the authors' CSV: image_name,image_id,bbox,object,score) usable with
    --region-table."""
    from storyrl.images import IMAGE_EXTENSIONS, detect_regions

    paths = list(images)
    if image_dir is not None:
        paths += sorted(p for p in image_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not paths:
        _fail("no images: pass image files or --image-dir")
    try:
        detect_regions(paths, out, weights=weights, top_b=top_b, score_threshold=score_threshold, device=device, progress=not quiet)
    except (FileNotFoundError, ValueError) as exc:  # ImageError is a ValueError
        _fail(str(exc))
    click.echo(f"wrote {out}")


@main.command()
@click.argument("names", nargs=-1)
@click.option("--dest", type=click.Path(file_okay=False, path_type=Path), help="Directory to put them in (default: storyrl's cache).")
@click.option("--force", is_flag=True, help="Download again even when present.")
def assets(names, dest, force) -> None:
    """Download the data files storyrl cannot ship (concreteness ratings,
    pronoun list) from their public sources, and say where they went."""
    from storyrl.assets import ASSETS, download_assets

    unknown = [n for n in names if n not in ASSETS]
    if unknown:
        _fail(f"unknown asset {unknown[0]!r}; available: {', '.join(ASSETS)}")
    try:
        paths = download_assets(list(names) or None, dest=dest, force=force)
    except RuntimeError as exc:
        _fail(str(exc))
    for path in paths:
        click.echo(str(path))


@main.group()
def train() -> None:
    """Train the learned metrics (RoViST-C coherence, RoViST-VG). Multi-GPU:
    run under `accelerate launch -m storyrl.cli train ...`."""


_TRAINERS = {
    "coherence": ("storyrl.training.coherence", "CoherenceTrainConfig", "train_coherence"),
    "rovist-vg": ("storyrl.training.rovist_vg", "RovistVGTrainConfig", "train_rovist_vg"),
}


def _train_command(kind: str):
    module_name, config_class, function = _TRAINERS[kind]

    @train.command(kind, help=f"Train the {kind} model from a config YAML: best model in OUTPUT_DIR/best, "
                   "resumable state in OUTPUT_DIR/last, one JSON line per epoch in OUTPUT_DIR/history.jsonl.")
    @click.option("--config", "config_path", required=True, type=_FILE, help=f"Training config YAML (configs/training/{kind.replace('-', '_')}.yaml).")
    @click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), help="Overrides the config's output_dir.")
    @click.option("--resume", is_flag=True, help="Continue from OUTPUT_DIR/last.")
    @click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
    @click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
    def command(config_path, output_dir, resume, max_steps, quiet) -> None:
        import importlib

        module = importlib.import_module(module_name)
        try:
            config = getattr(module, config_class).from_yaml(
                config_path, output_dir=str(output_dir) if output_dir else None, max_steps=max_steps
            )
            result = getattr(module, function)(config, resume=resume, progress=not quiet)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        click.echo(_json({
            "output_dir": config.output_dir,
            "best_epoch": result.best_epoch,
            "best_val_loss": result.best_val_loss,
            "epochs_run": result.epochs_run,
            "stopped_early": result.stopped_early,
        }))

    return command


for _kind in _TRAINERS:
    _train_command(_kind)


if __name__ == "__main__":
    main()
