"""Split the VIST test human stories into train and held-out sequences and
write them as storyrl JSONL records.

    python examples/rl_vist/prepare_data.py OUT_DIR [--stories gt_test.json]
        [--train 1500] [--heldout 200] [--val 100] [--heldout-fraction 0.2] [--seed 0]

The split is by story id: the ids are sorted (numerically) and the last
``--heldout-fraction`` of them form the held-out pool, the rest the train
pool. Consecutive ids tend to be stories of the same album (near-duplicate
stories of the same photos), so a contiguous split keeps them on one side,
apart from at most the album at the boundary. Stories whose human story has
fewer than two sentences (``storyrl.text.split_sentences``; about 3% of
VIST test, mostly stories written without full stops) are left out of both
pools: RoViST-NR and RoViST-C score nothing for them, so d_HM (as a reward
and in the evaluation) could not use them. ``--train`` / ``--heldout``
stories are then drawn from each pool (seeded) to fit the time budget, and
``--val`` more from the rest of the train pool: a validation set for choosing
learning rates and KL coefficients (sweep.py), so that the held-out set is
used for nothing but the final evaluation.

Each record: ``story_id``, ``story`` (the human story, which RL rewards read
as the ``reference``), ``image_ids`` (placeholders ``<id>-1`` .. ``<id>-5``:
they only tell storyrl that the sequence has five images; there are no image
files) and ``noun_phrases`` (the concrete words the prompt shows, see
common.py). Writes ``train.jsonl``, ``val.jsonl``, ``heldout.jsonl`` and
``split.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONCRETENESS, DEFAULT_STORIES, N_IMAGES, load_ratings, story_nouns


def _id_key(story_id: str):
    return (0, int(story_id), "") if story_id.isdigit() else (1, 0, story_id)


def split_ids(ids, heldout_fraction: float) -> tuple[list[str], list[str]]:
    """(train pool, held-out pool): the sorted ids, the last fraction held out."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout fraction must be in (0, 1), got {heldout_fraction}")
    ordered = sorted(ids, key=_id_key)
    n_heldout = max(1, round(heldout_fraction * len(ordered)))
    if n_heldout >= len(ordered):
        raise ValueError(f"{len(ordered)} stories cannot be split into train and held-out")
    return ordered[:-n_heldout], ordered[-n_heldout:]


def _draw(pool: list[str], n: int | None, rng: random.Random) -> list[str]:
    if n is None or n >= len(pool):
        return list(pool)
    return sorted(rng.sample(pool, n), key=_id_key)


def prepare(stories_path, out_dir, n_train: int | None, n_heldout: int | None, n_val: int = 0,
            heldout_fraction: float = 0.2, seed: int = 0, concreteness=DEFAULT_CONCRETENESS) -> dict:
    """Write train.jsonl, val.jsonl, heldout.jsonl and split.json to ``out_dir``; returns the split summary."""
    from storyrl.data import load_stories
    from storyrl.text import split_sentences

    stories = {r.story_id: r.story for r in load_stories(stories_path)}
    train_pool, heldout_pool = split_ids(list(stories), heldout_fraction)
    scorable = {sid for sid, story in stories.items() if len(split_sentences(story)) >= 2}
    unscorable = {"train": sum(1 for s in train_pool if s not in scorable),
                  "heldout": sum(1 for s in heldout_pool if s not in scorable)}
    train_pool = [s for s in train_pool if s in scorable]
    heldout_pool = [s for s in heldout_pool if s in scorable]
    if not train_pool or not heldout_pool:
        raise ValueError(f"{stories_path}: no story of two or more sentences in the "
                         f"{'train' if not train_pool else 'held-out'} pool")
    rng = random.Random(seed)
    chosen = {"train": _draw(train_pool, n_train, rng), "heldout": _draw(heldout_pool, n_heldout, rng)}
    taken = set(chosen["train"])
    chosen["val"] = _draw([s for s in train_pool if s not in taken], n_val, rng) if n_val else []
    ratings = load_ratings(concreteness)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    noun_counts = {}
    for name, ids in chosen.items():
        lines = []
        for sid in ids:
            nouns = story_nouns(stories[sid], ratings)
            noun_counts.setdefault(name, []).append(len(nouns))
            lines.append(json.dumps({"story_id": sid, "story": stories[sid],
                                     "image_ids": [f"{sid}-{k}" for k in range(1, N_IMAGES + 1)],
                                     "noun_phrases": nouns}, ensure_ascii=False))
        (out_dir / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    summary = {
        "stories": str(stories_path), "seed": seed, "heldout_fraction": heldout_fraction,
        "train_pool": {"n": len(train_pool), "first_id": train_pool[0], "last_id": train_pool[-1]},
        "heldout_pool": {"n": len(heldout_pool), "first_id": heldout_pool[0], "last_id": heldout_pool[-1]},
        "left_out_one_sentence": unscorable,
        "train": len(chosen["train"]), "val": len(chosen["val"]), "heldout": len(chosen["heldout"]),
        "nouns_per_story": {k: sum(v) / max(len(v), 1) for k, v in noun_counts.items()},
    }
    (out_dir / "split.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stories", type=Path, default=DEFAULT_STORIES,
                        help="VIST human stories {story_id: story} (default: $STORYRL_VIST_STORIES or "
                        "../shared/data/dhm/vist/gt_test.json)")
    parser.add_argument("--concreteness", type=Path, default=DEFAULT_CONCRETENESS)
    parser.add_argument("--train", type=int, default=1500, help="train stories drawn from the train pool")
    parser.add_argument("--heldout", type=int, default=200, help="held-out stories drawn from the held-out pool")
    parser.add_argument("--val", type=int, default=100,
                        help="validation stories drawn from the rest of the train pool (for sweeps)")
    parser.add_argument("--heldout-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for option, path, variable in (("--stories", args.stories, "STORYRL_VIST_STORIES"),
                                   ("--concreteness", args.concreteness, "STORYRL_CONCRETENESS")):
        if not path.is_file():  # one line, not a traceback
            sys.exit(f"prepare_data.py: {option}: no such file: {path} (set {option} or ${variable}; where to get it: "
                     "examples/rl_vist/README.md)")
    summary = prepare(args.stories, args.out, args.train, args.heldout, args.val, args.heldout_fraction, args.seed,
                      args.concreteness)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
