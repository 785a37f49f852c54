"""Generation command: ``generate`` (records with images -> story file and
sidecar), over :func:`storyrl.generators.runs.generate_to_file`."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _FILE, _check_outputs, _fail, _json
from storyrl.cli.config_options import GeneratedOptionsCommand, given, registry_options
from storyrl.cli.reward_options import input_paths
from storyrl.datasets import DATA_FORMATS
EPILOG = ("An option that only one generator declares is set with --<option>; an option of the same name with "
          "different meanings has the spelling --<generator>-<option> (e.g. --tapm-max-new-tokens).")


def _generator_options(own: set[str]) -> list[click.Parameter]:
    from storyrl.generators import GENERATORS

    return registry_options(GENERATORS, own=own)


@click.command(cls=GeneratedOptionsCommand, generate=_generator_options, epilog=EPILOG)
@click.option("--model", "-m", default=None,
              help="Vision-language model (hub name or directory; default: LLaVA-NeXT 1.6 Mistral-7B) or a "
                   "trained TAPM directory.")
@click.option("--generator", "generator_name", default=None,
              help="Generator to run (storyrl generate picks tapm for a TAPM directory, else prompting).")
@click.option("--data", "-d", required=True, type=_FILE,
              help="Stories with images: storyrl JSONL records (images, or image_ids with --image-root), "
                   "a VIST story-in-sequence JSON or the VWP CSV.")
@click.option("--data-format", type=click.Choice(DATA_FORMATS), default="auto", show_default=True,
              help="Format of --data.")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Story file to write: JSON {story_id: story}; the sidecar OUT.meta.json records the settings.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N stories of --data.")
@click.option("--resume", is_flag=True, help="Keep the stories already in OUT and generate the rest.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT and sidecar.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def generate(model, generator_name, data, data_format, out, limit, resume, overwrite, quiet, **values) -> None:
    """Generate one story per record of --data and write OUT
    ({story_id: story}, the story set `storyrl score` reads) with its sidecar
    OUT.meta.json (generator, options, model revision, prompt text, failures).
    Stories are written as they come; --resume continues an interrupted run.
    A failed story is listed in the sidecar with its error, never written as
    text; the command exits non-zero when no story was generated."""
    from storyrl.data import StoryDataError
    from storyrl.datasets import load_records
    from storyrl.generators import GENERATORS, create_generator, generator_for_model
    from storyrl.generators.runs import generate_to_file, sidecar_path

    if resume and overwrite:
        _fail("--resume and --overwrite exclude each other")
    if out.suffix.lower() != ".json":
        _fail(f"--out {out}: story files are JSON; name it *.json")
    name = generator_name or (generator_for_model(model) if model else "prompting")
    if name not in GENERATORS:
        _fail(f"--generator {name}: unknown; choose from {', '.join(GENERATORS.names())}")
    options = _options_for(name, values)
    if model is not None:
        options["model"] = model
    _check_outputs({"--out": out, "sidecar": sidecar_path(out)}, [data, *input_paths(values)],
                   "keep" if resume or overwrite else "refuse")
    try:
        generator = create_generator(name, **options)
        records = load_records(data, data_format)
    except (TypeError, ValueError, StoryDataError) as exc:
        _fail(str(exc))
    if not records:
        _fail(f"{data}: no stories")
    records = records[:limit] if limit else records
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the weight-loading bars too
    try:
        run = generate_to_file(generator, records, out, resume=resume, overwrite=overwrite, progress=not quiet,
                               inputs={"data": str(data), "limit": limit})
    except (TypeError, ValueError) as exc:
        _fail(str(exc))
    for sid, error in list(run.failures.items())[:5]:
        click.echo(f"failed: {sid}: {error}", err=True)
    if len(run.failures) > 5:
        click.echo(f"... {len(run.failures) - 5} more failures in {run.sidecar}", err=True)
    click.echo(_json({"out": str(out), "stories": len(run.stories), "failures": len(run.failures),
                      "resumed": run.resumed, "sidecar": str(run.sidecar)}))
    if not run.stories:
        _fail(f"no story was generated ({len(run.failures)} failures; see {run.sidecar})")


def _options_for(name: str, values: dict) -> dict:
    """The options given for generator ``name``; one meant for another
    generator only is an error (it would be silently ignored)."""
    from storyrl.cli.config_options import split_registry_options
    from storyrl.config import option_info
    from storyrl.generators import GENERATORS

    options = split_registry_options(GENERATORS, values, [name])[name]
    declared = {info.name for info in option_info(GENERATORS.get(name).config_class)}
    for key in given(values):
        entry, sep, option = key.partition("__")
        if (sep and entry != name) or (not sep and key not in declared):
            flag = "--" + key.replace("__", "-").replace("_", "-")
            _fail(f"{flag} does not apply to the {name} generator")
    return options
