"""Rewrite a ``storyrl pairs`` file's stories with VIST spacing (``common.vist_spacing``).

    python examples/rl_vist/space_pairs.py out/rl_vist/pairs/train_dhm.jsonl out/rl_vist/pairs/train_dhm.spaced.jsonl \
        --data out/rl_vist/data/train.jsonl

``storyrl pairs --policy`` writes the sampled stories as the policy's
tokenizer decodes them ("seats. the year"); this example's word-level
tokenizer splits on whitespace only, so DPO and the reward model, which
tokenize the pairs' text again, would read every word glued to a full stop
or comma as ``[UNK]`` (10% of the tokens). Spaced back ("seats . the year")
the text tokenizes to known words again and decodes to the same story. Every
other field (prompt, scores, margin) is kept. With ``--data`` (the records
the pairs were sampled for) each pair also gets its sequence's human story as
``reference``, which ``storyrl meta-eval pairs`` gives reference-based
metrics such as ``dhm``. With ``--scores`` the pairs also get
``better_id`` / ``worse_id`` and the scores ``storyrl pairs`` ranked them by
(``chosen_score``, ``rejected_score``) go to a score table (story_id,
``labels``) that ``storyrl meta-eval pairs --scores`` reads: the labelling
metric's own accuracy, 1 by construction (every kept pair has a margin);
its column ``shorter`` (minus the spaced story's token count: words and
punctuation) is the baseline that
prefers the shorter story.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import vist_spacing


def story_key(story_id: str, story: str) -> str:
    """A per-story id: the sequence and a digest of the (spaced) text."""
    return f"{story_id}:{hashlib.sha1(story.encode('utf-8')).hexdigest()[:10]}"


def space_pairs(source: Path, target: Path, data: Path | None = None, scores: Path | None = None) -> int:
    """Write ``source``'s pairs to ``target`` with spaced stories (and, with
    ``data``, their human story as ``reference``); returns the pair count."""
    humans = None
    if data is not None:
        humans = {}
        for line in data.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                humans[str(record["story_id"])] = record["story"]
    rows = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in ("chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise SystemExit(f"{source}:{number}: no {key!r} story; is this a storyrl pairs file?")
            row[key] = vist_spacing(row[key])
        if humans is not None:
            if str(row.get("story_id")) not in humans:
                raise SystemExit(f"{source}:{number}: story_id {row.get('story_id')!r} is not in {data}; "
                                 "give the --data the pairs were sampled for")
            row["reference"] = humans[str(row["story_id"])]
        if scores is not None:
            row["better_id"] = story_key(str(row.get("story_id")), row["chosen"])
            row["worse_id"] = story_key(str(row.get("story_id")), row["rejected"])
        rows.append(row)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    if scores is not None:
        table = {}
        for row in rows:
            table[row["better_id"]] = (row["chosen_score"], -len(row["chosen"].split()))
            table[row["worse_id"]] = (row["rejected_score"], -len(row["rejected"].split()))
        with scores.open("w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["story_id", "labels", "shorter"])
            writer.writerows([key, *values] for key, values in sorted(table.items()))
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--data", type=Path, help="records JSONL of the sequences: adds each pair's human story "
                        "as reference")
    parser.add_argument("--scores", type=Path, help="CSV to write the pairs' ranking scores to (column labels)")
    args = parser.parse_args()
    if args.source.resolve() == args.target.resolve():
        parser.error("target must differ from source (the original pairs are kept)")
    print(f"{space_pairs(args.source, args.target, args.data, args.scores)} pairs -> {args.target}")


if __name__ == "__main__":
    main()
