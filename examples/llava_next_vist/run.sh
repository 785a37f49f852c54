#!/usr/bin/env bash
# The paper-scale recipe (README.md): VIST records, a RoViST-C model, the
# zero-shot LLaVA-NeXT-7B baseline, SFT (LoRA) on the train split's human
# stories, GRPO against the grounded d_HM reward from the SFT model, DPO on
# d_HM-ranked pairs of the SFT model's own stories, and every system's d_HM,
# KL and story statistics on the VIST test split. One 80 GB GPU.
#
#   bash examples/llava_next_vist/run.sh                            # every step, in order
#   STORYRL_RECIPE_PRINT=1 bash examples/llava_next_vist/run.sh     # the steps' commands only (NUL-separated)
#
# Rerun the same command after an interruption: a finished step (a file in
# runs/llava_next_vist/done/) is skipped, and every command continues its own
# interrupted run (--resume) or writes its output whole at its end, so nothing
# is computed twice or overwritten (the few --overwrite flags rewrite tables
# that are pure functions of files already written). Settings: settings.sh
# and the YAML files beside this script. Paths are relative to the checkout's
# root (STORYRL_RECIPE_ROOT to run elsewhere): data/vist/ in, runs/llava_next_vist/ out.
set -euo pipefail
cd "${STORYRL_RECIPE_ROOT:-$(dirname "$0")/../..}"
if [ -z "${STORYRL_RECIPE_PRINT:-}" ] && [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    . .venv/bin/activate  # the README's install; any environment with storyrl works
fi

E=examples/llava_next_vist
D=data/vist
R=runs/llava_next_vist
. "$E/settings.sh"
# Optional: the d_HM authors' own zero-shot stories (LLaVA-NeXT, visual setting, P3) of the VIST
# test set, data/stories/vist/llava_vc_p3.json of https://github.com/akskuchi/dHM-visual-storytelling;
# when the file is there they are scored as one more system, next to storyrl's zero-shot stories.
PAPER_STORIES=data/dhm/vist/llava_vc_p3.json

step() {  # step NAME -- COMMAND...: run COMMAND unless step NAME has finished before
    local name=$1
    shift 2
    if [ -n "${STORYRL_RECIPE_PRINT:-}" ]; then
        printf 'STEP\0%s\0' "$name"
        printf '%s\0' "$@"
        return
    fi
    if [ -f "$R/done/$name" ]; then
        echo "[$name] finished before: skipped"
        return
    fi
    echo "[$(date +%T)] $name: $*"
    "$@"
    mkdir -p "$R/done" && touch "$R/done/$name"
}

# 1. Data: each VIST split's stories whose five images are all there and decode, as storyrl records.
for split in train val test; do
    ids=()
    [ "$split" = test ] && ids=(--image-ids-out "$D/records/test_image_ids.json")
    step "records_$split" -- storyrl records "$D/sis/$split.story-in-sequence.json" --image-root "$D/images/$split" \
        -o "$D/records/$split.jsonl" ${ids[@]+"${ids[@]}"} --overwrite -q
done

# 2. RoViST-C, the coherence model of the dhm reward and of the evaluation.
step coherence -- storyrl train coherence --config "$E/coherence.yaml" --resume -q

# 3. The test split's human stories scored as the paper scores them (GROOViST, RoViST-C, RoViST-NR).
EVAL_REWARDS=(--config "$E/rewards/groovist.yaml" --config "$E/rewards/coherence.yaml"
              --config "$E/rewards/repetition.yaml")
step score_human -- storyrl score "$D/records/test.jsonl" "${EVAL_REWARDS[@]}" --image-root "$D/images/test" \
    -o "$R/eval/human/scores.csv" --resume -q
SYSTEMS=()

scored() {  # scored NAME STORIES: score a story file of the test split, its d_HM, and add it to the table
    local name=$1 stories=$2
    step "score_$name" -- storyrl score "$stories" "${EVAL_REWARDS[@]}" --image-ids "$D/records/test_image_ids.json" \
        --image-root "$D/images/test" -o "$R/eval/$name/scores.csv" --resume -q
    step "dhm_$name" -- storyrl dhm --human "$R/eval/human/scores.csv" --model "$R/eval/$name/scores.csv" \
        --per-story "$R/eval/$name/dhm.csv" --overwrite
    SYSTEMS+=(--system "$name" "$stories" "$R/eval/$name/scores.csv")
}

evaluated() {  # evaluated NAME MODEL [START]: MODEL's test stories, scored; with START its KL to START
    local name=$1 model=$2
    step "generate_$name" -- storyrl generate --model "$model" --data "$D/records/test.jsonl" \
        --image-root "$D/images/test" --setting visual --prompt "$PROMPT" --max-new-tokens "$GEN_MAX_NEW_TOKENS" \
        --batch-size "$GEN_BATCH_SIZE" --out "$R/eval/$name/stories.json" --resume -q
    scored "$name" "$R/eval/$name/stories.json"
    if [ $# -ge 3 ]; then
        step "kl_$name" -- storyrl kl "$R/eval/$name/stories.json" --reference "$3" --batch-size "$KL_BATCH_SIZE" \
            -o "$R/eval/$name/kl.csv" --resume -q
        SYSTEMS+=(--scores "$name" "$R/eval/$name/kl.csv")
    fi
}

# 4. The zero-shot baseline (and, when downloaded, the authors' own zero-shot stories).
evaluated zero_shot "$BASE_MODEL"
if [ -f "$PAPER_STORIES" ]; then
    scored paper_zero_shot "$PAPER_STORIES"
fi

# 5. SFT (LoRA) on the train split's human stories; its KL is to the zero-shot model.
step sft -- storyrl train sft --config "$E/sft.yaml" --resume -q
evaluated sft "$R/sft/final" "$BASE_MODEL"

# 6. GRPO against the dhm reward, from the SFT model; KL to the SFT model.
step grpo_dhm -- storyrl train rl --config "$E/grpo_dhm.yaml" --resume -q
evaluated grpo_dhm "$R/grpo_dhm/final" "$R/sft/final"

# 7. The alternative: DPO on d_HM-ranked pairs of the SFT model's own stories; KL to the SFT model.
step pairs -- storyrl pairs --policy "$R/sft/final" --data "$D/records/train.jsonl" --image-root "$D/images/train" \
    --limit "$PAIRS_LIMIT" -k "$PAIRS_K" --temperature "$PAIRS_TEMPERATURE" --max-new-tokens "$PAIRS_MAX_NEW_TOKENS" \
    --seed "$PAIRS_SEED" --min-margin "$PAIRS_MIN_MARGIN" --config "$E/dhm.yaml" -o "$R/pairs/train.jsonl" --resume
step dpo -- storyrl train dpo --config "$E/dpo.yaml" --resume -q
evaluated dpo "$R/dpo/final" "$R/sft/final"

# 8. Every system on the test split, against the human stories and the zero-shot baseline.
step compare -- storyrl compare --human "$D/records/test.jsonl" "$R/eval/human/scores.csv" "${SYSTEMS[@]}" \
    --baseline zero_shot --resamples "$BOOTSTRAP_RESAMPLES" --seed "$BOOTSTRAP_SEED" \
    -o "$R/eval/results.md" --json "$R/eval/results.json" --overwrite
[ -n "${STORYRL_RECIPE_PRINT:-}" ] || cat "$R/eval/results.md"
