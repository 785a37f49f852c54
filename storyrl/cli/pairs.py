"""``storyrl pairs``: preference pairs (TRL's preference JSONL) from people
(--vhed, --vist-edit) or from a reward over several story sets
(:mod:`storyrl.eval.pairs`)."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _check_outputs, _fail, _json, _metric_list, _same_file
from storyrl.cli.config_options import GeneratedOptionsCommand, reward_options
from storyrl.cli.reward_options import EPILOG, attach_context_files, context_file_options, input_paths, make_rewards


@click.command("pairs", cls=GeneratedOptionsCommand, generate=lambda own: reward_options(own=own), epilog=EPILOG)
@click.argument("stories", nargs=-1, type=_FILE)
@click.option("--vhed", type=_FILE, help="VHED-format CSV: its ranked pairs (zero-gap pairs dropped).")
@click.option("--vist-edit", "vist_edit", type=_DIR,
              help="VIST-Edit root: every human edit preferred to its machine story.")
@click.option("--metrics", "-m", default="", help="The reward ranking STORIES' stories (one name).")
@click.option("--config", "configs", multiple=True, type=_FILE, help="Reward config YAML, instead of --metrics.")
@click.option("--min-margin", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Keep a metric pair only when best score - other score is above this.")
@click.option("--prompt", default=None, help="The prompt text of every pair (default: a generic story prompt).")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Pairs JSONL to write (*.jsonl).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1), help="Stories per scoring batch.")
@context_file_options
def pairs_cmd(stories, vhed, vist_edit, metrics, configs, min_margin, prompt, out, overwrite, batch_size,
              image_id_map, noun_phrase_map, **reward_values) -> None:
    """Write preference pairs as TRL preference JSONL (prompt, chosen,
    rejected, images, story_id, source, chosen_score, rejected_score, margin)
    from exactly one source: --vhed, --vist-edit, or two or more STORIES
    files (story sets of the same records) ranked by one reward (-m or
    --config): each record's best story against each other one, ties,
    unscorable stories and margins at or below --min-margin dropped.
    Prints a JSON summary line: pairs kept, dropped by reason."""
    import math

    from storyrl.eval.pairs import DEFAULT_PROMPT, human_pair_rows, metric_pairs

    names = _metric_list(metrics)
    sources = [flag for flag, given in (("--vhed", vhed), ("--vist-edit", vist_edit), ("STORIES", stories)) if given]
    if len(sources) != 1:
        _fail("give exactly one source: --vhed, --vist-edit, or two or more STORIES files", exit_code=2)
    if not stories and (names or configs):
        _fail(f"--metrics/--config rank STORIES files; {sources[0]} pairs come from people", exit_code=2)
    if stories and len(stories) < 2:
        _fail("give two or more STORIES files (story sets of the same records) to pair", exit_code=2)
    if stories and len(names) + len(configs) != 1:
        _fail("rank STORIES by exactly one reward: one --metrics name or one --config", exit_code=2)
    if not math.isfinite(min_margin):
        _fail(f"--min-margin must be a finite number, got {min_margin}", exit_code=2)
    for k, path in enumerate(stories):
        if any(_same_file(path, other) for other in stories[:k]):
            _fail(f"STORIES: {path} is given twice", exit_code=2)
    if out.suffix.lower() != ".jsonl":
        _fail(f"--out {out}: pairs are JSONL files; name it *.jsonl", exit_code=2)
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    inputs = [*stories, vhed, vist_edit, *configs, image_id_map, noun_phrase_map, *input_paths(reward_values)]
    _check_outputs({"--out": out}, inputs, "keep" if overwrite else "refuse", hint="use --overwrite to replace it")

    summary: dict = {"out": str(out)}
    if vhed is not None:
        from storyrl.judgements.pairs import vhed_pairs
        from storyrl.judgements.vhed import load_vhed

        data = load_vhed(vhed)
        rows = human_pair_rows(vhed_pairs(data), prompt)
        dropped = {"zero_gap_pairs": data.zero_gap_dropped}
    elif vist_edit is not None:
        from storyrl.judgements.vist_edit import load_vist_edit, vist_edit_pairs

        rows = human_pair_rows(vist_edit_pairs(load_vist_edit(vist_edit)), prompt)
        dropped = {}
    else:
        from storyrl.data import load_stories

        (reward,) = make_rewards(names, configs, reward_values)
        sets = []
        for path in stories:
            records = load_stories(path)
            attach_context_files(records, image_id_map, noun_phrase_map)
            sets.append((str(path), records))
        reward.setup()  # models load before anything is written
        rows, dropped = metric_pairs(sets, reward, min_margin=min_margin, prompt=prompt, batch_size=batch_size)
        summary["reward"] = reward.name
        dropped = dict(dropped)
    summary.update(pairs=len(rows), dropped=dropped)
    if not rows:
        _fail(f"no pair kept, nothing written to {out} (dropped: {_json(dropped)})")

    import json

    from storyrl.output_files import replace_file

    replace_file(out, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), overwrite=overwrite)
    click.echo(_json(summary))
