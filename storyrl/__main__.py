"""Entry point of the ``storyrl`` command (and ``python -m storyrl``).

Kept tiny: the command-line module is imported inside :func:`main`, so Ctrl-C
while it loads ends with one line and exit code 130, like Ctrl-C later on
(which storyrl.cli handles), instead of a traceback.
"""

import sys


def main() -> None:
    try:
        from storyrl.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("Error: interrupted\n")
        raise SystemExit(130) from None
    cli(prog_name="storyrl")


if __name__ == "__main__":
    main()
