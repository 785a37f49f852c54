"""Entry point of the ``storyrl`` command (and ``python -m storyrl``, ``python -m storyrl.cli``).

Kept tiny: the command-line module is imported inside :func:`main`, so Ctrl-C
while it loads ends with one line and exit code 130, like Ctrl-C later on
(which storyrl.cli handles), instead of a traceback.
"""

from __future__ import annotations

import sys


def main(prog_name: str | None = "storyrl") -> None:
    """Run the command line; ``prog_name=None`` lets click name the program
    (``python -m storyrl.cli`` uses that)."""
    try:
        from storyrl.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("Error: interrupted\n")
        raise SystemExit(130) from None
    cli(prog_name=prog_name)


if __name__ == "__main__":
    main()
