#!/usr/bin/env bash
# The rl_vist experiment, end to end on CPU (about 34 minutes on 2 cores at
# load 1-3.5; see README.md): split the VIST test human stories into train and
# held-out sequences, pretrain (SFT) a tiny storyteller and a tiny RoViST-C
# coherence model on the train split, fine-tune the storyteller with PPO,
# GRPO and RLOO against d_HM (coherence + repetition) and against raw
# repetition, and with DPO on d_HM-ranked pairs of its own stories; train a
# story reward model on those pairs and measure its pair accuracy on pairs of
# the validation sequences; evaluate every policy on the held-out sequences.
#
#   bash examples/rl_vist/run.sh
#
# Environment: STORYRL_VIST_STORIES (default ../shared/data/dhm/vist/gt_test.json),
# STORYRL_CONCRETENESS (default ../shared/data/groovist/concreteness_ratings.csv),
# OMP_NUM_THREADS (default 1: on a machine shared with other work, 2 threads
# were up to 15x slower than 1 for these tiny models). Everything goes to
# out/rl_vist/ (git-ignored); every step's output directory is removed before
# the step runs, so the script can be rerun as is. Logs: out/rl_vist/logs/.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    . .venv/bin/activate  # the README's install; any environment with storyrl works
fi

STORIES="${STORYRL_VIST_STORIES:-../shared/data/dhm/vist/gt_test.json}"
CONCRETENESS="${STORYRL_CONCRETENESS:-../shared/data/groovist/concreteness_ratings.csv}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
OUT=out/rl_vist
EX=examples/rl_vist

need() {  # need FILE VARIABLE WHAT SOURCE: one line and exit 1 when a data file is absent, before anything runs
    [ -f "$1" ] && return
    echo "rl_vist: no $3 at $1: get $4 and set $2 to its path (see $EX/README.md)" >&2
    exit 1
}
need "$STORIES" STORYRL_VIST_STORIES "VIST test human stories" \
    "data/stories/vist/gt_test.json of https://github.com/akskuchi/dHM-visual-storytelling"
need "$CONCRETENESS" STORYRL_CONCRETENESS "concreteness ratings" \
    "data/concreteness_ratings.csv of https://github.com/akskuchi/groovist"
RUNS=(ppo_dhm grpo_dhm rloo_dhm ppo_repetition grpo_repetition rloo_repetition)
SEED=0

mkdir -p "$OUT/logs"
rm -f "$OUT/times.tsv" "$OUT/logs/"*.log
{ echo "started $(date -Is) on $(getconf _NPROCESSORS_ONLN) cores, OMP_NUM_THREADS=$OMP_NUM_THREADS"; echo "load: $(cat /proc/loadavg)"; } \
    > "$OUT/logs/machine.txt"
total_began=$SECONDS

step() {  # step NAME COMMAND...: run it, output to logs/NAME.log, wall time to times.tsv
    local name=$1 began=$SECONDS
    shift
    echo "[$(date +%T)] $name (load $(cut -d' ' -f1-3 /proc/loadavg))"
    if ! "$@" > "$OUT/logs/$name.log" 2>&1; then
        tail -n 30 "$OUT/logs/$name.log"
        echo "rl_vist: step $name failed; its log: $OUT/logs/$name.log" >&2
        exit 1
    fi
    printf '%s\t%d\n' "$name" $((SECONDS - began)) >> "$OUT/times.tsv"
    echo "load after $name: $(cat /proc/loadavg)" >> "$OUT/logs/machine.txt"
}

rm -rf "$OUT/data"
step data python $EX/prepare_data.py "$OUT/data" --stories "$STORIES" --concreteness "$CONCRETENESS" \
    --train 1500 --val 100 --heldout 200 --seed $SEED
rm -rf "$OUT/policy"
step policy python $EX/make_policy.py "$OUT/data/train.jsonl" "$OUT/policy" --heldout "$OUT/data/heldout.jsonl" \
    --steps 400 --seed $SEED
rm -rf "$OUT/albert_base" "$OUT/coherence"
step albert python $EX/make_albert.py "$OUT/data/train.jsonl" "$OUT/albert_base" --seed $SEED
step coherence storyrl train coherence --config $EX/coherence.yaml --quiet

for run in "${RUNS[@]}"; do
    rm -rf "$OUT/runs/$run"
    step "$run" python $EX/train_rl.py --config "$EX/$run.yaml" --quiet
done

# SFT -> DPO next to SFT -> RL: preference pairs of the start policy's own stories (4 per
# train sequence, the RL runs' sampling) ranked by the RL runs' d_HM reward, then DPO on them;
# the same pairs train a story reward model, whose pair accuracy is measured on pairs of the
# validation sequences. storyrl_nouns.py: storyrl's CLI with the nouns in the prompts.
PAIRS=(-k 4 --config $EX/dhm.yaml --temperature 0.7 --max-new-tokens 96 --seed $SEED --min-margin 0.005)
rm -rf "$OUT/pairs"
mkdir -p "$OUT/pairs"
step pairs_dhm python $EX/storyrl_nouns.py pairs --policy "$OUT/policy" --data "$OUT/data/train.jsonl" "${PAIRS[@]}" \
    -o "$OUT/pairs/train_dhm.jsonl"
step pairs_val python $EX/storyrl_nouns.py pairs --policy "$OUT/policy" --data "$OUT/data/val.jsonl" "${PAIRS[@]}" \
    -o "$OUT/pairs/val_dhm.jsonl"
for split in train val; do  # VIST spacing for the word-level tokenizer; references and label scores for meta-eval
    python $EX/space_pairs.py "$OUT/pairs/${split}_dhm.jsonl" "$OUT/pairs/${split}_dhm.spaced.jsonl" \
        --data "$OUT/data/$split.jsonl" --scores "$OUT/pairs/${split}_dhm.scores.csv" >> "$OUT/logs/space_pairs.log"
done
rm -rf "$OUT/runs/dpo_dhm"
step dpo_dhm python $EX/storyrl_nouns.py train dpo --config $EX/dpo_dhm.yaml --quiet
rm -rf "$OUT/reward_model" "$OUT/reward_model_eval"
step reward_model storyrl train reward_model --config $EX/reward_model_dhm.yaml --quiet
step reward_model_eval storyrl meta-eval pairs --pairs "$OUT/pairs/val_dhm.spaced.jsonl" \
    -m reward_model,coherence,repetition --reward-model-model "$OUT/reward_model/final" \
    --coherence-model "$OUT/coherence/best" --scores "$OUT/pairs/val_dhm.scores.csv" \
    -o "$OUT/reward_model_eval/val_pairs.csv" --quiet

rm -rf "$OUT/eval"
policies=(--policy "start=$OUT/policy")
# dpo_dhm last: evaluate.py seeds each policy's bootstrap by its position, so the RL rows stay as they were.
for run in "${RUNS[@]}" dpo_dhm; do policies+=(--policy "$run=$OUT/runs/$run/final"); done
step eval python $EX/evaluate.py --heldout "$OUT/data/heldout.jsonl" --coherence-model "$OUT/coherence/best" \
    "${policies[@]}" --out "$OUT/eval" --runs-dir "$OUT/runs" --times "$OUT/times.tsv" --samples 2 --seed $SEED

echo "finished $(date -Is), total $((SECONDS - total_began)) s" >> "$OUT/logs/machine.txt"
cat "$OUT/eval/results.md"
echo
cat "$OUT/reward_model_eval/val_pairs.md"
echo
cat "$OUT/logs/machine.txt"
echo "rl_vist: done in $((SECONDS - total_began)) s; table $OUT/eval/results.md, plot $OUT/eval/results.png"
