"""``storyrl kl``: a storyteller's KL to its start policy along its own
stories (:mod:`storyrl.eval.story_kl`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _check_outputs, _fail, _json
from storyrl.datasets import DATA_FORMATS
from storyrl.models.runtime import PRECISIONS


@click.command("kl")
@click.argument("stories", type=_FILE)
@click.option("--reference", required=True,
              help="The start policy (hub name or directory; LoRA adapters load merged into their base).")
@click.option("--policy", default=None,
              help="The model that wrote STORIES (default: the one its sidecar records).")
@click.option("--data", type=_FILE, default=None,
              help="The records STORIES were generated for (default: the data file its sidecar records).")
@click.option("--data-format", type=click.Choice(list(DATA_FORMATS)), default="auto", show_default=True,
              help="Format of the data.")
@click.option("--image-root", type=_DIR, default=None,
              help="Directory of the data's images (default: the image root its sidecar records).")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Score CSV to write: story_id,kl (nats per story).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Stories per forward pass.")
@click.option("--device", default=None, help="Device of both models (default: the generation run's).")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default=None,
              help="dtype of both models (default: the generation run's).")
@click.option("--resume", is_flag=True, help="Keep the rows already in OUT and measure the other stories.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def kl(stories, reference, policy, data, data_format, image_root, out, batch_size, device, precision, resume,
       overwrite, quiet) -> None:
    """For each story of STORIES (a `storyrl generate` story file, visual
    setting), the KL of the model that wrote it to --reference summed over
    the story's tokens: both models read the story after the prompt and
    sequence image it was generated from (rebuilt from the sidecar
    STORIES.meta.json). Writes story_id,kl rows as they come (`storyrl
    compare --scores NAME OUT` reports the mean); prints a JSON summary line."""
    from storyrl.console import progress as progress_bar
    from storyrl.data import ScoreWriter, StoryDataError, load_stories
    from storyrl.datasets import load_records
    from storyrl.eval.story_kl import KL_COLUMN, prompting_options, story_kl
    from storyrl.generators.runs import check_sidecar, sidecar_path
    from storyrl.output_files import OutputError

    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other", exit_code=2)
    if out.suffix.lower() != ".csv":
        _fail(f"--out {out}: score files are CSV; name it *.csv", exit_code=2)
    meta_path = sidecar_path(stories)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except OSError as exc:
        _fail(f"{meta_path}: cannot read the sidecar of {stories} ({exc.strerror or exc}); KL needs the prompts "
              "`storyrl generate` recorded there")
    except ValueError as exc:
        _fail(f"{meta_path}: {exc}")
    try:
        meta = check_sidecar(meta_path, meta)  # its message names the file
    except ValueError as exc:
        _fail(str(exc))
    try:
        options = prompting_options(meta)
    except ValueError as exc:
        _fail(f"{meta_path}: {exc}")
    if data is None:
        data = (meta.get("inputs") or {}).get("data")
        if not data:
            _fail(f"{meta_path}: records no data file; give --data")
        if not isinstance(data, str):
            _fail(f"{meta_path}: the inputs' data must be a file name, got {json.dumps(data)}")
    options.update({k: v for k, v in (("image_root", None if image_root is None else str(image_root)),
                                      ("device", device), ("precision", precision)) if v is not None})
    _check_outputs({"--out": out}, [stories, data, meta_path], "keep" if resume or overwrite else "refuse")
    try:
        texts = {r.story_id: r.story for r in load_stories(stories)}
        records = load_records(data, data_format)
    except (OSError, StoryDataError, ValueError) as exc:
        _fail(str(exc))
    try:
        writer = ScoreWriter(out, [KL_COLUMN], resume=resume, overwrite=overwrite)
    except (OutputError, StoryDataError, ValueError) as exc:
        _fail(str(exc))
    with writer:
        todo = {sid: text for sid, text in texts.items() if sid not in writer.done}
        with progress_bar(total=len(todo), unit="story", disable=quiet) as bar:
            try:
                values = story_kl(todo, records, options, reference=reference, policy=policy, batch_size=batch_size,
                                  progress=bar.update,
                                  done=lambda ids, vals: writer.write(ids, {KL_COLUMN: vals}))
            except (TypeError, ValueError) as exc:
                _fail(str(exc))
    finite = [v for v in values.values() if v == v]
    unmeasured = len(values) - len(finite)
    if unmeasured:
        from storyrl.eval.story_kl import story_problem
        from storyrl.models.vlm import load_vlm  # loaded already: shared by name and settings

        processor = load_vlm(policy or options["model"], options.get("revision"), options.get("device"),
                             options.get("precision", "auto"), options.get("load_in_4bit", False)).processor
        reasons = Counter(story_problem(processor, todo[sid]) for sid, v in values.items() if v != v)
        for reason, count in reasons.items():
            click.echo(f"{count} stories not measured: {reason}", err=True)
    click.echo(_json({"out": str(out), "stories": len(values), "measured": len(finite), "resumed": len(writer.done),
                      "mean_kl": sum(finite) / len(finite) if finite else None,
                      "policy": policy or options.get("model"), "reference": reference}))
