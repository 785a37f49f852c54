"""``storyrl meta-eval pairs`` on ``storyrl pairs`` rows that carry the
sequence's human story as ``reference``: d_HM (repetition only, no model)
scores each story against it; accuracy by hand from RoViST-NR."""

from __future__ import annotations

import csv
import json

from click.testing import CliRunner

from storyrl.cli import main
from storyrl.rewards import create_reward

HUMAN = "we drove to the coast early . mia ran into the cold waves . dad built a tall castle ."
NEAR = "we drove to the coast . mia ran into the waves . dad built a castle ."
ALSO_NEAR = "we went to the coast . mia swam in the waves . dad made a castle ."
DULL = "the beach . the beach . the beach . the beach ."
LOOP = "the beach was nice . the beach was nice . the beach was nice ."


def test_dhm_scores_pairs_against_their_reference(tmp_path):
    rep = create_reward("repetition")
    human, near, also, dull, loop = (float(s) for s in rep.score([HUMAN, NEAR, ALSO_NEAR, DULL, LOOP]))
    # pair a: the chosen story is nearer the human one (d_HM right); pair b: farther (d_HM wrong)
    assert abs(human - near) < abs(human - dull) and abs(human - loop) > abs(human - also)
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "p", "chosen": NEAR, "rejected": DULL, "reference": HUMAN, "story_id": "a", "images": []},
            {"prompt": "p", "chosen": LOOP, "rejected": ALSO_NEAR, "reference": HUMAN, "story_id": "b", "images": []}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "dhm.yaml"
    config.write_text("reward: dhm\ndimensions: [repetition]\n")
    out = tmp_path / "t.csv"
    result = CliRunner().invoke(main, ["meta-eval", "pairs", "--pairs", str(pairs), "--config", str(config),
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    with open(out, newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["subset"], r["metric"], r["n"]) for r in table] == [("all", "dhm", "2")]
    assert float(table[0]["accuracy"]) == 0.5 and "unscorable" not in result.output

    # Both pairs right when the second's stories swap sides: the accuracy follows the reference.
    rows[1]["chosen"], rows[1]["rejected"] = ALSO_NEAR, LOOP
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["meta-eval", "pairs", "--pairs", str(pairs), "--config", str(config),
                                       "-o", str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    with open(out, newline="") as handle:
        assert float(next(csv.DictReader(handle))["accuracy"]) == 1.0
