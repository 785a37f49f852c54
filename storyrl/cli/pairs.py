"""``storyrl pairs``: preference pairs (TRL's preference JSONL) from people
(--vhed, --vist-edit), from a reward over several story sets, or from a
reward over k stories sampled from a policy (--policy)
(:mod:`storyrl.eval.pairs`)."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _DIR, _FILE, _check_outputs, _fail, _json, _metric_list, _same_file
from storyrl.cli.config_options import GeneratedOptionsCommand, reward_options
from storyrl.cli.reward_options import EPILOG, attach_context_files, context_file_options, input_paths, make_rewards
from storyrl.datasets import DATA_FORMATS
from storyrl.training.storyteller.config import SETTINGS

# Sampling options: only with --policy (None = not given; defaults below).
SAMPLING_DEFAULTS = {"k": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 128, "seed": 0,
                     "prompt_name": "P3", "setting": "auto", "data_format": "auto", "policy_kind": "auto"}


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
@click.option("--policy", "policy", default=None,
              help="Sample stories from this policy (local directory or hub name; full weights or LoRA adapters "
              "on their base), as `storyrl train rl` prompts it.")
@click.option("--policy-kind", type=click.Choice(["auto", "causal_lm", "vlm"]), default=None,
              help="--policy: its kind; auto reads the model's config.  [default: auto]")
@click.option("--data", type=_FILE, default=None,
              help="--policy: image sequences with their human stories (VIST SIS JSON, VWP CSV, storyrl JSONL).")
@click.option("--data-format", type=click.Choice(list(DATA_FORMATS)), default=None,
              help="--policy: format of --data.  [default: auto]")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="--policy: only the first N sequences.")
@click.option("-k", "k", type=click.IntRange(min=2), default=None,
              help="--policy: stories sampled per sequence.  [default: 4]")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--policy: sampling temperature.  [default: 1.0]")
@click.option("--top-p", "top_p", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="--policy: nucleus sampling mass.  [default: 1.0]")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="--policy: story length limit in tokens.  [default: 128]")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="--policy: sampling seed (the same command samples the same stories).  [default: 0]")
@click.option("--prompt-name", default=None, help="--policy: prompt name in the prompts file.  [default: P3]")
@click.option("--prompts-file", type=_FILE, default=None,
              help="--policy: prompt templates YAML (default: configs/prompts/dhm.yaml).")
@click.option("--setting", type=click.Choice(list(SETTINGS)), default=None,
              help="--policy: what it sees (as in `storyrl train rl`).  [default: auto]")
@click.option("--resume", is_flag=True,
              help="--policy: reuse the sequences already sampled into OUT's samples file and sample the rest.")
@context_file_options
def pairs_cmd(stories, vhed, vist_edit, metrics, configs, min_margin, prompt, out, overwrite, batch_size,
              policy, policy_kind, data, data_format, limit, k, temperature, top_p, max_new_tokens, seed,
              prompt_name, prompts_file, setting, resume, image_id_map, noun_phrase_map, **reward_values) -> None:
    """Write preference pairs as TRL preference JSONL (prompt, chosen,
    rejected, images, story_id, source, chosen_score, rejected_score, margin)
    from exactly one source: --vhed, --vist-edit, two or more STORIES
    files (story sets of the same records), or --policy with --data (k
    stories sampled per sequence). Stories are ranked by one reward (-m or
    --config): each record's best story against each other one, ties,
    unscorable stories and margins at or below --min-margin dropped.
    Prints a JSON summary line: pairs kept, dropped by reason."""
    import math

    from storyrl.eval.pairs import DEFAULT_PROMPT, human_pair_rows, metric_pairs

    names = _metric_list(metrics)
    sampling = {"policy_kind": policy_kind, "data": data, "data_format": data_format, "limit": limit, "k": k,
                "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
                "prompt_name": prompt_name, "prompts_file": prompts_file, "setting": setting}
    sources = [flag for flag, given in (("--vhed", vhed), ("--vist-edit", vist_edit), ("STORIES", stories),
                                        ("--policy", policy)) if given]
    if len(sources) != 1:
        _fail("give exactly one source: --vhed, --vist-edit, two or more STORIES files, or --policy", exit_code=2)
    if policy is None:
        extra = [f"--{key.replace('_', '-')}" for key, value in sampling.items() if value is not None]
        extra += ["--resume"] if resume else []
        if extra:
            _fail(f"{extra[0]} is a --policy option (sampling stories from a policy)", exit_code=2)
    else:
        _pairs_from_policy(policy, names, configs, min_margin, prompt, out, overwrite, resume, batch_size,
                           image_id_map, noun_phrase_map, reward_values,
                           {key: SAMPLING_DEFAULTS.get(key) if value is None else value
                            for key, value in sampling.items()})
        return
    if not stories and (names or configs):
        _fail(f"--metrics/--config rank STORIES files; {sources[0]} pairs come from people", exit_code=2)
    if stories and len(stories) < 2:
        _fail("give two or more STORIES files (story sets of the same records) to pair", exit_code=2)
    if stories and len(names) + len(configs) != 1:
        _fail("rank STORIES by exactly one reward: one --metrics name or one --config", exit_code=2)
    if not math.isfinite(min_margin):
        _fail(f"--min-margin must be a finite number, got {min_margin}", exit_code=2)
    for index, path in enumerate(stories):
        if any(_same_file(path, other) for other in stories[:index]):
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
        try:  # VHED gives image ids: --image-root turns them into the rows' image paths
            rows = human_pair_rows(vhed_pairs(data), prompt, image_root=reward_values.get("image_root"))
        except ValueError as exc:
            _fail(f"--vhed {vhed}: {exc}")
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


def _base_model(policy: str) -> str:
    """The model a policy directory's LoRA adapters sit on (the policy itself otherwise)."""
    from storyrl.models.pretrained import adapter_base, is_adapter_dir

    if not is_adapter_dir(policy):
        return policy
    try:
        return adapter_base(policy)[0]
    except ValueError as exc:
        _fail(f"--policy {policy}: {exc}")


def _pairs_from_policy(policy, names, configs, min_margin, prompt, out, overwrite, resume, batch_size,
                       image_id_map, noun_phrase_map, reward_values, opts) -> None:
    """``storyrl pairs --policy``: sample, rank, write (module docs of
    :mod:`storyrl.eval.pairs`)."""
    import json
    import math
    from collections import Counter

    from storyrl.eval.pairs import open_samples, policy_pairs, sample_stories, samples_path
    from storyrl.output_files import LockedOutput, OutputError

    if opts["data"] is None:
        _fail("--policy needs --data (the image sequences to sample stories for)", exit_code=2)
    if len(names) + len(configs) != 1:
        _fail("rank the sampled stories by exactly one reward: one --metrics name or one --config", exit_code=2)
    if prompt is not None:
        _fail("--prompt: a policy's pairs carry the prompt it was sampled with; choose it with --prompt-name "
              "and --prompts-file", exit_code=2)
    if image_id_map is not None or noun_phrase_map is not None:
        _fail("--image-ids/--noun-phrases: with --policy the sequences come from --data", exit_code=2)
    if resume and overwrite:
        _fail("--resume continues OUT's samples, --overwrite samples again: give one", exit_code=2)
    if not math.isfinite(min_margin):
        _fail(f"--min-margin must be a finite number, got {min_margin}", exit_code=2)
    if out.suffix.lower() != ".jsonl":
        _fail(f"--out {out}: pairs are JSONL files; name it *.jsonl", exit_code=2)
    sidecar = samples_path(out)
    inputs = [opts["data"], opts["prompts_file"], *configs, *input_paths(reward_values)]
    _check_outputs({"--out": out, "samples file": sidecar}, inputs,
                   "keep" if overwrite or resume else "refuse")

    from storyrl.training.storyteller.config import StorytellerConfig

    image_root = reward_values.get("image_root")
    precision = reward_values.get("precision") or "auto"
    try:
        config = StorytellerConfig.from_mapping({
            "model": _base_model(policy), "policy": opts["policy_kind"], "data": str(opts["data"]),
            "data_format": opts["data_format"], "limit": opts["limit"], "image_root": image_root,
            "setting": opts["setting"], "prompt": opts["prompt_name"],
            "prompts_file": None if opts["prompts_file"] is None else str(opts["prompts_file"]),
            "precision": precision})
        kind = config.policy_kind()
    except (TypeError, ValueError) as exc:
        _fail(f"--policy {policy}: {' '.join(str(exc).split())}")
    if kind == "tapm":
        _fail(f"--policy {policy}: a TAPM policy is prompted by visual features, not by RL's prompt rows; "
              "sample its stories with `storyrl generate` and pair the story sets")
    # What the samples depend on: a resumed run must have sampled with the same.
    local = Path(policy).exists()
    options = {"policy": str(Path(policy).resolve()) if local else policy, "kind": kind,
               "data": str(Path(opts["data"]).resolve()), "data_format": opts["data_format"], "limit": opts["limit"],
               "k": opts["k"], "temperature": opts["temperature"], "top_p": opts["top_p"],
               "max_new_tokens": opts["max_new_tokens"], "seed": opts["seed"], "prompt_name": opts["prompt_name"],
               "prompts_file": None if opts["prompts_file"] is None else str(Path(opts["prompts_file"]).resolve()),
               "setting": opts["setting"], "image_root": None if image_root is None else str(Path(image_root).resolve()),
               "precision": precision}

    (reward,) = make_rewards(names, configs, reward_values)
    from storyrl.training.storyteller.rl.data import load_data, prompt_rows
    from storyrl.training.storyteller.rl.policy import load_policy

    try:
        records = load_data(config)
    except (TypeError, ValueError) as exc:
        _fail(f"--data: {' '.join(str(exc).split())}")
    seen = set()
    for record in records:  # samples are keyed by story id (the sidecar, --resume)
        if record.story_id in seen:
            _fail(f"--data {opts['data']}: story id {record.story_id!r} appears twice; each sequence needs its own id")
        seen.add(record.story_id)
    try:
        loaded = load_policy(config, kind, path=policy)
        rows = prompt_rows(config, records, kind, loaded.processing_class)
    except (TypeError, ValueError) as exc:
        _fail(f"--policy {policy}: {' '.join(str(exc).split())}")
    for row in rows:
        row.pop("images", None)  # a VLM's loaded images: prompt_rows makes them again per row below
    reward.setup()  # models load before anything is written

    from storyrl.models.runtime import resolve_device

    model = loaded.model
    if not config.load_in_4bit:
        model.to(resolve_device(reward_values.get("device")))
    model.eval()
    existed = out.exists() and out.stat().st_size > 0
    try:
        locked_out = LockedOutput(out, existing="keep" if overwrite or resume else "refuse")
    except OutputError as exc:
        _fail(str(exc))
    try:
        try:
            store, done = open_samples(sidecar, options, resume=resume, overwrite=overwrite)
        except (OutputError, ValueError) as exc:
            _fail(str(exc), exit_code=2 if isinstance(exc, ValueError) else 1)
        done = {sid: texts for sid, texts in done.items() if sid in seen}
        counts = Counter({"sampled_stories": 0, "stories_not_round_tripping": 0})
        try:
            samples = sample_stories(loaded, rows, opts["k"], prepare=_image_loader(config, kind, loaded.processing_class),
                                     store=store, done=done, temperature=opts["temperature"],
                                     top_p=opts["top_p"], max_new_tokens=opts["max_new_tokens"], seed=opts["seed"],
                                     counts=counts)
        finally:
            store.close()
        if counts["stories_not_round_tripping"]:
            click.echo(f"warning: {counts['stories_not_round_tripping']} of {counts['sampled_stories']} sampled "
                       f"stories ({counts['stories_not_round_tripping'] / counts['sampled_stories']:.1%}) do not "
                       "re-encode to the tokens the policy sampled (the tokenizer's decoding is lossy): DPO or a "
                       "reward model trained on these pairs sees other tokens than the policy made", err=True)
        pair_rows, dropped = policy_pairs(rows, samples, reward, source=f"policy {policy}", min_margin=min_margin,
                                          batch_size=batch_size)
        summary = {"out": str(out), "samples": str(sidecar), "policy": policy, "reward": reward.name,
                   "pairs": len(pair_rows), "dropped": dict(dropped),
                   "sequences": {"sampled": len(rows) - len(done), "reused": len(done)},
                   # of the stories sampled in this run (reused ones keep no token ids)
                   "stories_not_round_tripping": counts["stories_not_round_tripping"]}
        if not pair_rows:
            _fail(f"no pair kept, nothing written to {out} (dropped: {_json(dict(dropped))}); the samples stay "
                  f"in {sidecar}")
        locked_out.replace("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in pair_rows))
    except BaseException:
        if not existed:
            locked_out.discard()
        raise
    finally:
        locked_out.close()
    click.echo(_json(summary))


def _image_loader(config, kind, processing_class):
    """A VLM row's sequence images, loaded just before the row is sampled
    (a long data file's images would not fit in memory); None otherwise."""
    if kind != "vlm":
        return None
    from storyrl.training.storyteller.rl.data import _Prompter

    prompter = _Prompter(config, kind, processing_class)
    return lambda row: {**row, "images": prompter.images(row["story_id"], row["story_images"])}
