#!/usr/bin/env bash
# The main job on the bundled example stories: score the human and both model
# story sets, then print each model's d_HM distance to the human stories.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${STORYRL_EXAMPLE_OUT:-out/example}
mkdir -p "$out"
metrics=${STORYRL_EXAMPLE_METRICS:-repetition}
for set in human model_a model_b; do
  echo "== scores: $set"
  storyrl score "examples/$set.jsonl" --metrics "$metrics" --out "$out/$set.csv" --overwrite --quiet
done
for model in model_a model_b; do
  echo "== d_HM: $model vs human"
  storyrl dhm --human "$out/human.csv" --model "$out/$model.csv" --metrics "$metrics" --per-story "$out/${model}_dhm.csv" --overwrite
done
