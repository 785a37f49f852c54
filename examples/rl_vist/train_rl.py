"""``storyrl train rl`` with each sequence's nouns in its prompt
(``storyrl_nouns.py``'s hook; see there).

    python examples/rl_vist/train_rl.py --config examples/rl_vist/grpo_dhm.yaml [any storyrl train rl option]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storyrl_nouns import install_hook, nouns_prompt  # noqa: F401  (the hook, as tests import it from here)
from storyrl_nouns import main as storyrl_main


def main(argv: list[str] | None = None) -> None:
    storyrl_main(["train", "rl", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
