"""Any ``storyrl`` command with each sequence's nouns in its prompt.

    python examples/rl_vist/storyrl_nouns.py train rl --config examples/rl_vist/grpo_dhm.yaml
    python examples/rl_vist/storyrl_nouns.py pairs --policy out/rl_vist/policy --data ... -k 4 ...

This is storyrl's own command line (``storyrl.cli.main``, same options, same
outputs), run with one hook: storyrl builds a text policy's prompt from the
sequence's image count alone (the visual prompt P3, "... using only five
sentences ..."), which is all a text policy can know of images it does not
see. Here the images are replaced by the human story's concrete words
(common.py), so the hook appends each record's ``noun_phrases`` to its
prompt, exactly as the pretraining and the evaluation show them
(``common.add_nouns``). It wraps the two functions every storyteller command
builds prompts with: ``build_dataset`` (RL, SFT, DPO's samples) and
``prompt_rows`` (sampling stories: ``storyrl pairs --policy``). Only
causal-LM policies with a chat template are supported (the example's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_nouns


def nouns_prompt(prompt, nouns):
    """A dataset row's prompt (a conversation of one user message) with ``nouns`` added."""
    if not (isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0].get("content"), str)):
        raise ValueError("rl_vist: expected a causal-LM chat prompt (one user message with text content), "
                         f"got {prompt!r:.200}")
    return [{**prompt[0], "content": add_nouns(prompt[0]["content"], nouns)}]


def _causal_lm_only(kind: str) -> None:
    if kind != "causal_lm":
        raise ValueError(f"rl_vist: the nouns hook is for causal-LM policies, not {kind}")


def install_hook():
    """Wrap ``storyrl.training.storyteller.rl.data.build_dataset`` and ``prompt_rows`` so
    that each row's prompt gets its record's nouns. Returns a function that
    puts the originals back."""
    from storyrl.training.storyteller.rl import data

    original_dataset, original_rows = data.build_dataset, data.prompt_rows
    if getattr(original_dataset, "_rl_vist", False):
        return lambda: None

    def build_dataset(config, kind, processing_class, records=None):
        records = data.load_data(config) if records is None else list(records)
        _causal_lm_only(kind)
        dataset = original_dataset(config, kind, processing_class, records)
        nouns = {r.story_id: list(r.noun_phrases or []) for r in records}
        return dataset.map(lambda row: {"prompt": nouns_prompt(row["prompt"], nouns[row["story_id"]])})

    def prompt_rows(config, records, kind, processing_class):
        records = list(records)
        _causal_lm_only(kind)
        rows = original_rows(config, records, kind, processing_class)
        for row, record in zip(rows, records):
            row["prompt"] = nouns_prompt(row["prompt"], list(record.noun_phrases or []))
        return rows

    build_dataset._rl_vist = True
    data.build_dataset, data.prompt_rows = build_dataset, prompt_rows

    def uninstall() -> None:
        data.build_dataset, data.prompt_rows = original_dataset, original_rows

    return uninstall


def main(argv: list[str] | None = None) -> None:
    install_hook()
    from storyrl.cli import main as storyrl_cli

    storyrl_cli(args=list(sys.argv[1:] if argv is None else argv), prog_name="storyrl")


if __name__ == "__main__":
    main()
