"""Print an RL run's reward curve and the reward-hacking monitors from its
history.jsonl: python examples/rl/show_rewards.py out/rl_example/run"""

import json
import sys
from pathlib import Path

COLUMNS = {"reward": "rewards/repetition/mean", "sentences": "story/sentences_mean",
           "tokens": "story/tokens_mean", "distinct-2": "story/distinct_2", "KL": "kl"}

rows = [json.loads(line) for line in (Path(sys.argv[1]) / "history.jsonl").read_text().splitlines()]
rows = [r for r in rows if COLUMNS["reward"] in r]
if not rows:
    sys.exit(f"{sys.argv[1]}/history.jsonl: no logged step")
print("step  " + "  ".join(f"{name:>10}" for name in COLUMNS))
for r in rows:
    print(f"{r['step']:>4}  " + "  ".join(f"{r.get(key, float('nan')):>10.3f}" for key in COLUMNS.values()))
first = sum(r[COLUMNS["reward"]] for r in rows[:5]) / len(rows[:5])
last = sum(r[COLUMNS["reward"]] for r in rows[-5:]) / len(rows[-5:])
print(f"mean reward, first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
