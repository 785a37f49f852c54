#!/usr/bin/env bash
# RL example on CPU (1.5 to 8 minutes on 2 cores, by load; see README.md): build a tiny story policy, fine-tune it
# with GRPO against the repetition reward, print the reward curve.
set -euo pipefail
cd "$(dirname "$0")/../.."
python examples/rl/make_policy.py out/rl_example/policy
rm -rf out/rl_example/run
storyrl train rl --config examples/rl/grpo_repetition.yaml --quiet
python examples/rl/show_rewards.py out/rl_example/run
