# Settings of run.sh's command-line steps (the YAML files hold the trainers'
# and rewards' settings). Plain NAME=value lines, read by run.sh with `.`;
# tests/test_example_llava_next_vist.py changes only the sizes and the model.

# The d_HM paper's zero-shot storyteller (LLaVA-NeXT 1.6, Mistral-7B decoder)
# and the start of every training run.
BASE_MODEL=llava-hf/llava-v1.6-mistral-7b-hf

# storyrl generate, every system on the test split: the paper's visual setting
# (the five images side by side as one image), prompt P3, greedy decoding,
# at most 500 new tokens (the paper's settings); stories per generate call.
PROMPT=P3
GEN_MAX_NEW_TOKENS=500
GEN_BATCH_SIZE=8

# storyrl pairs: K stories sampled from the SFT model for each of the first
# PAIRS_LIMIT train sequences, ranked by dhm.yaml; each sequence's best story
# against each other one, margins <= PAIRS_MIN_MARGIN dropped.
PAIRS_LIMIT=1000
PAIRS_K=4
PAIRS_TEMPERATURE=1.0
PAIRS_MAX_NEW_TOKENS=160
PAIRS_MIN_MARGIN=0.005
PAIRS_SEED=0

# storyrl kl: stories per forward pass of the two models.
KL_BATCH_SIZE=4

# storyrl compare: bootstrap resamples of the test story ids, and the seed.
BOOTSTRAP_RESAMPLES=2000
BOOTSTRAP_SEED=0
