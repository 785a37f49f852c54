"""``storyrl train rl`` with each sequence's nouns in its prompt.

    python examples/rl_vist/train_rl.py --config examples/rl_vist/grpo_dhm.yaml [any storyrl train rl option]

This is storyrl's own command (``storyrl.cli.main(["train", "rl", ...])``,
same options, same outputs), run with one hook: storyrl builds a text
policy's prompt from the sequence's image count alone (the visual prompt P3,
"... using only five sentences ..."), which is all a text policy can know of
images it does not see. Here the images are replaced by the human story's
concrete words (common.py), so the hook appends each record's
``noun_phrases`` to its prompt, exactly as the pretraining and the
evaluation show them (``common.add_nouns``). Only causal-LM policies with a
chat template are supported (the example's).
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


def install_hook():
    """Wrap ``storyrl.training.rl.data.build_dataset`` (what ``storyrl train rl``
    builds its prompts with) so that each row's prompt gets its record's
    nouns. Returns a function that puts the original back."""
    from storyrl.training.rl import data

    original = data.build_dataset
    if getattr(original, "_rl_vist", False):
        return lambda: None

    def build_dataset(config, kind, processing_class, records=None):
        records = data.load_data(config) if records is None else list(records)
        if kind != "causal_lm":
            raise ValueError(f"rl_vist: the nouns hook is for causal-LM policies, not {kind}")
        dataset = original(config, kind, processing_class, records)
        nouns = {r.story_id: list(r.noun_phrases or []) for r in records}
        return dataset.map(lambda row: {"prompt": nouns_prompt(row["prompt"], nouns[row["story_id"]])})

    build_dataset._rl_vist = True
    data.build_dataset = build_dataset

    def uninstall() -> None:
        data.build_dataset = original

    return uninstall


def main(argv: list[str] | None = None) -> None:
    install_hook()
    from storyrl.cli import main as storyrl_cli

    storyrl_cli(args=["train", "rl", *(sys.argv[1:] if argv is None else argv)], prog_name="storyrl")


if __name__ == "__main__":
    main()
