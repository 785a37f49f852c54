#!/usr/bin/env bash
# The rl_vist experiment, end to end on CPU, over training seeds (see README.md for
# the time it took): split the VIST test human stories into train and held-out
# sequences, pretrain (SFT) a tiny storyteller and a tiny RoViST-C coherence model
# on the train split, fine-tune the storyteller with PPO, GRPO and RLOO against
# d_HM (coherence + repetition) and against raw repetition, and with DPO on
# d_HM-ranked pairs of its own stories, once per training seed; train a story
# reward model on those pairs and measure its pair accuracy on pairs of the
# validation sequences; evaluate every policy on the held-out sequences, check
# the README's conclusions seed by seed, and write the README's results block.
#
#   bash examples/rl_vist/run.sh
#
# Environment: STORYRL_VIST_STORIES (default ../shared/data/dhm/vist/gt_test.json),
# STORYRL_CONCRETENESS (default ../shared/data/groovist/concreteness_ratings.csv),
# RL_VIST_SEEDS (training seeds, default "0 1 2"), RL_VIST_JOBS (steps run at
# once, default the number of cores), RL_VIST_README (the README whose results
# block is rewritten, default examples/rl_vist/README.md; "none": no README),
# OMP_NUM_THREADS (default 1 per step: on a machine shared with other work, 2
# threads were up to 15x slower than 1 for these tiny models).
# Everything goes to out/rl_vist/ (git-ignored); logs in out/rl_vist/logs/. A
# rerun resumes: a step that finished (out/rl_vist/done/STEP) is skipped, one that
# did not is run again from scratch; remove out/rl_vist to start over.
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
read -r -a SEEDS <<< "${RL_VIST_SEEDS:-0 1 2}"
JOBS="${RL_VIST_JOBS:-$(getconf _NPROCESSORS_ONLN)}"
README="${RL_VIST_README:-$EX/README.md}"
for s in "${SEEDS[@]}"; do
    [[ "$s" =~ ^[0-9]+$ ]] || { echo "rl_vist: RL_VIST_SEEDS: '$s' is not a seed (a whole number)" >&2; exit 1; }
done
[ "${#SEEDS[@]}" -gt 0 ] || { echo "rl_vist: RL_VIST_SEEDS is empty" >&2; exit 1; }
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "rl_vist: RL_VIST_JOBS: '$JOBS' is not a positive whole number" >&2; exit 1; }
SEED=0  # the shared steps' seed: data split, start policy, coherence model, pairs, reward model, evaluation
COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no -- . ":(exclude)$EX/README.md" ":(exclude)$EX/results.png")" ]; then
    COMMIT="$COMMIT+uncommitted"
fi

set -m  # each background step in its own process group, so that stopping it stops its python too
stop_steps() { for pid in $(jobs -rp); do kill -- -"$pid" 2>/dev/null || true; done; }
trap 'stop_steps; exit 130' INT TERM  # stop the background steps too
mkdir -p "$OUT/logs" "$OUT/done"
rm -rf "$OUT/failed"
mkdir -p "$OUT/failed"
{ echo "started $(date -Is) at $COMMIT on $(getconf _NPROCESSORS_ONLN) cores, OMP_NUM_THREADS=$OMP_NUM_THREADS," \
    "$JOBS steps at once, seeds ${SEEDS[*]}"; echo "load: $(cat /proc/loadavg)"; } >> "$OUT/logs/machine.txt"
total_began=$SECONDS

step() {  # step NAME "PATHS TO CLEAR" COMMAND...: skipped when done; else clear, run (log: logs/NAME.log), mark done
    local name=$1 clear=$2 began=$SECONDS load
    shift 2
    if [ -f "$OUT/done/$name" ]; then
        echo "[$(date +%T)] $name: finished before, skipped"
        return 0
    fi
    load=$(cut -d' ' -f1 /proc/loadavg)
    echo "[$(date +%T)] $name (load $load)"
    # shellcheck disable=SC2086  # the paths are words
    rm -rf $clear
    if ! "$@" > "$OUT/logs/$name.log" 2>&1; then
        tail -n 30 "$OUT/logs/$name.log"
        echo "rl_vist: step $name failed; its log: $OUT/logs/$name.log" >&2
        touch "$OUT/failed/$name"
        return 1
    fi
    # the marker holds the step's times.tsv line: name, seconds, commit, load before and after
    printf '%s\t%d\t%s\t%s\t%s\n' "$name" $((SECONDS - began)) "$COMMIT" "$load" "$(cut -d' ' -f1 /proc/loadavg)" \
        > "$OUT/done/$name.tmp"
    mv "$OUT/done/$name.tmp" "$OUT/done/$name"
}

failed() {  # stop everything when a step failed: finished steps stay done, so a rerun resumes
    if [ -n "$(ls -A "$OUT/failed")" ]; then
        stop_steps
        wait 2>/dev/null || true
        echo "rl_vist: failed: $(ls "$OUT/failed" | tr '\n' ' ')(logs in $OUT/logs); run again to resume" >&2
        exit 1
    fi
}

submit() {  # submit NAME "PATHS" COMMAND...: step in the background, at most $JOBS at once
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
        wait -n || true
        failed
    done
    failed
    step "$@" &
}

drain() {  # wait for every submitted step
    wait || true
    failed
}

pairs_split() {  # pairs_split SPLIT: the start policy's d_HM-ranked pairs of SPLIT, spaced (see README)
    python $EX/storyrl_nouns.py pairs --policy "$OUT/policy" --data "$OUT/data/$1.jsonl" \
        -k 4 --config $EX/dhm.yaml --temperature 0.7 --max-new-tokens 96 --seed $SEED --min-margin 0.005 \
        -o "$OUT/pairs/$1_dhm.jsonl" && \
    python $EX/space_pairs.py "$OUT/pairs/$1_dhm.jsonl" "$OUT/pairs/$1_dhm.spaced.jsonl" \
        --data "$OUT/data/$1.jsonl" --scores "$OUT/pairs/$1_dhm.scores.csv"
}

EVAL=(--heldout "$OUT/data/heldout.jsonl" --coherence-model "$OUT/coherence/best" --out "$OUT/eval"
      --runs-dir "$OUT/runs" --samples 2 --seed $SEED --policy "start=$OUT/policy")

# 1. data, the start policy (SFT) and the coherence model: shared by every seed
step data "$OUT/data" python $EX/prepare_data.py "$OUT/data" --stories "$STORIES" --concreteness "$CONCRETENESS" \
    --train 1500 --val 100 --heldout 200 --seed $SEED
step albert "$OUT/albert_base" python $EX/make_albert.py "$OUT/data/train.jsonl" "$OUT/albert_base" --seed $SEED
submit policy "$OUT/policy" python $EX/make_policy.py "$OUT/data/train.jsonl" "$OUT/policy" \
    --heldout "$OUT/data/heldout.jsonl" --steps 400 --seed $SEED
submit coherence "$OUT/coherence" storyrl train coherence --config $EX/coherence.yaml --quiet
drain

# 2. the RL runs, once per seed, next to the preference pairs of the start policy's own stories
# (4 per sequence, the RL runs' sampling, ranked by the RL runs' d_HM reward) and the start's evaluation
mkdir -p "$OUT/pairs"
submit pairs_train "$OUT/pairs/train_dhm*" pairs_split train
submit pairs_val "$OUT/pairs/val_dhm*" pairs_split val
submit eval_start "$OUT/eval/policies/start.json" python $EX/evaluate.py "${EVAL[@]}" --no-report
for seed in "${SEEDS[@]}"; do
    for run in "${RUNS[@]}"; do
        submit "$run@$seed" "$OUT/runs/$run@$seed $OUT/eval/policies/$run@$seed.json" \
            python $EX/train_rl.py --config "$EX/$run.yaml" --seed "$seed" --output-dir "$OUT/runs/$run@$seed" --quiet
    done
done
drain

# 3. SFT -> DPO next to SFT -> RL, once per seed; the story reward model on the same pairs;
# the RL policies' held-out evaluation
for seed in "${SEEDS[@]}"; do
    submit "dpo_dhm@$seed" "$OUT/runs/dpo_dhm@$seed $OUT/eval/policies/dpo_dhm@$seed.json" \
        python $EX/storyrl_nouns.py train dpo --config $EX/dpo_dhm.yaml --seed "$seed" \
        --output-dir "$OUT/runs/dpo_dhm@$seed" --quiet
done
submit reward_model "$OUT/reward_model" storyrl train reward_model --config $EX/reward_model_dhm.yaml --quiet
for seed in "${SEEDS[@]}"; do
    for run in "${RUNS[@]}"; do
        submit "eval_$run@$seed" "$OUT/eval/policies/$run@$seed.json" \
            python $EX/evaluate.py "${EVAL[@]}" --policy "$run@$seed=$OUT/runs/$run@$seed/final" --no-report
    done
done
drain

for seed in "${SEEDS[@]}"; do
    submit "eval_dpo_dhm@$seed" "$OUT/eval/policies/dpo_dhm@$seed.json" \
        python $EX/evaluate.py "${EVAL[@]}" --policy "dpo_dhm@$seed=$OUT/runs/dpo_dhm@$seed/final" --no-report
done
submit reward_model_eval "$OUT/reward_model_eval" storyrl meta-eval pairs --pairs "$OUT/pairs/val_dhm.spaced.jsonl" \
    -m reward_model,coherence,repetition --reward-model-model "$OUT/reward_model/final" \
    --coherence-model "$OUT/coherence/best" --scores "$OUT/pairs/val_dhm.scores.csv" \
    -o "$OUT/reward_model_eval/val_pairs.csv" --quiet
drain

# 4. the tables: every policy together (evaluated above, so read back), then the seeds report and the README block
ls -tr "$OUT/done" | grep -v '\.tmp$' | while read -r name; do cat "$OUT/done/$name"; done > "$OUT/times.tsv"
policies=()
for run in "${RUNS[@]}" dpo_dhm; do
    for seed in "${SEEDS[@]}"; do policies+=(--policy "$run@$seed=$OUT/runs/$run@$seed/final"); done
done
python $EX/evaluate.py "${EVAL[@]}" "${policies[@]}" --times "$OUT/times.tsv" > "$OUT/logs/eval.log" 2>&1 \
    || { tail -n 30 "$OUT/logs/eval.log"; echo "rl_vist: the evaluation table failed; log: $OUT/logs/eval.log" >&2; exit 1; }
readme=()
[ "$README" = none ] || readme=(--readme "$README")
python $EX/report.py --results "$OUT/eval/results.json" --times "$OUT/times.tsv" --done "$OUT/done" --jobs "$JOBS" \
    --reward-model-table "$OUT/reward_model_eval/val_pairs.md" "${readme[@]}" > "$OUT/logs/report.log" 2>&1 \
    || { tail -n 30 "$OUT/logs/report.log"; echo "rl_vist: the report failed; log: $OUT/logs/report.log" >&2; exit 1; }

echo "finished $(date -Is), total $((SECONDS - total_began)) s" >> "$OUT/logs/machine.txt"
cat "$OUT/eval/seeds.md"
echo
tail -n 3 "$OUT/logs/machine.txt"
echo "rl_vist: done in $((SECONDS - total_began)) s; tables $OUT/eval/seeds.md and results.md, plot $OUT/eval/results.png${readme:+, ${README} rewritten between its markers}"
