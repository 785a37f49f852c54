"""``python -m storyrl.cli``: the ``storyrl`` command, kept for
``accelerate launch -m storyrl.cli train ...``.

It goes through storyrl.__main__ so both ways of starting exit alike; the
usage lines name ``python -m storyrl.cli``, as they did before the split.
"""

from storyrl.__main__ import main

if __name__ == "__main__":
    main(prog_name=None)
