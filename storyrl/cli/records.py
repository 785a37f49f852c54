"""``storyrl records``: a story file (VIST SIS JSON, VWP CSV, storyrl JSON or
JSONL) as storyrl JSONL records, keeping only the stories whose images can
all be read (:func:`storyrl.images.availability.check_sequences`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _check_outputs, _fail, _json
from storyrl.datasets import DATA_FORMATS

#: Dropped stories named in the summary line (the rest are counted).
SHOWN_DROPPED = 5


@click.command("records")
@click.argument("data", type=_FILE)
@click.option("--data-format", type=click.Choice(list(DATA_FORMATS)), default="auto", show_default=True,
              help="Format of DATA.")
@click.option("--image-root", type=_DIR, default=None,
              help="Directory that image ids and relative image paths are resolved in (VIST: <id>.jpg, .png, ...).")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Records to write (*.jsonl): story_id, story and the images as DATA gives them.")
@click.option("--image-ids-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write JSON {story_id: [image ids]} of the kept stories (what `storyrl score --image-ids` "
                   "reads for story files without images).")
@click.option("--decode/--no-decode", default=True, show_default=True,
              help="Decode every image (a broken file is found now, not mid-training); --no-decode only checks "
                   "that each image file exists.")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Threads decoding images.")
@click.option("--overwrite", is_flag=True, help="Replace existing output files.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def records(data, data_format, image_root, out, image_ids_out, decode, workers, overwrite, quiet) -> None:
    """Write the stories of DATA whose images can all be read as storyrl
    JSONL records (the `data` every storyrl trainer, `generate` and
    `pairs --policy` read), in DATA's order; a story with an image that is
    missing or (with --decode) does not decode is left out and counted by
    reason. Prints a JSON summary line; exits non-zero when no story is
    kept."""
    from storyrl.console import progress as progress_bar
    from storyrl.data import StoryDataError
    from storyrl.datasets import load_records
    from storyrl.images.availability import check_sequences
    from storyrl.output_files import OutputError, replace_file

    if out.suffix.lower() != ".jsonl":
        _fail(f"--out {out}: records are JSONL; name it *.jsonl", exit_code=2)
    if image_ids_out is not None and image_ids_out.suffix.lower() != ".json":
        _fail(f"--image-ids-out {image_ids_out}: an image-id map is JSON; name it *.json", exit_code=2)
    _check_outputs({"--out": out, "--image-ids-out": image_ids_out}, [data], "keep" if overwrite else "refuse",
                   hint="use --overwrite to replace it")
    try:
        stories = load_records(data, data_format)
    except (StoryDataError, ValueError) as exc:
        _fail(str(exc))
    if not stories:
        _fail(f"{data}: no stories")
    if image_ids_out is not None:
        without = next((r.story_id for r in stories if not r.image_ids), None)
        if without is not None:
            _fail(f"--image-ids-out: story {without!r} of {data} has no image ids (its images are paths)")
    with progress_bar(unit="image", disable=quiet or not decode) as bar:
        try:
            check = check_sequences(stories, image_root, decode=decode, workers=workers, progress=bar.update)
        except ValueError as exc:
            _fail(str(exc))
    if not check.kept:
        first = next(iter(check.dropped.items()))
        _fail(f"{data}: no story has all its images readable ({len(check.dropped)} left out; e.g. story "
              f"{first[0]!r}: {first[1]}); is --image-root the directory of the images?")
    try:
        replace_file(out, "".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in check.kept),
                     overwrite=overwrite)
        if image_ids_out is not None:
            replace_file(image_ids_out, json.dumps({r.story_id: r.image_ids for r in check.kept},
                                                   ensure_ascii=False) + "\n", overwrite=overwrite)
    except OutputError as exc:
        _fail(str(exc))
    dropped = list(check.dropped.items())
    for story_id, why in dropped[:SHOWN_DROPPED]:
        click.echo(f"left out: story {story_id}: {why}", err=True)
    if len(dropped) > SHOWN_DROPPED:
        click.echo(f"... {len(dropped) - SHOWN_DROPPED} more stories left out", err=True)
    click.echo(_json({"out": str(out), "stories": len(stories), "kept": len(check.kept), "dropped": len(dropped),
                      "reasons": dict(check.reasons), "images_checked": check.images if decode else 0,
                      "decoded": decode}))
