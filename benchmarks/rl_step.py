"""Benchmark: where the time of one RL step goes -- generation, the policy's
no-grad log-probability forwards, the reward, and the optimisation -- for a
PPO, a GRPO and an RLOO step with the same composite reward, on the same
policy, in one run; and each generation phase next to plain ``generate``
on the same model, batch and lengths (issue 32).

What is timed
-------------
The algorithms train the same tiny random LLaMA policy (``--policy-size``;
LoRA adapters r 16 on q/k/v/o as the shipped configs, ``--lora off`` for
full fine-tuning)
on the same prompt dataset against the same reward, through storyrl's
normal RL path (an :class:`~storyrl.training.storyteller.rl.config.RLConfig` built here;
rewards from ``RLConfig.build_rewards`` and set up before training, the
policy from ``load_policy``, the prompt dataset from ``build_dataset``):

* PPO: storyrl's :class:`~storyrl.training.storyteller.rl.ppo.PPOTrainer`, built with
  the arguments ``storyrl train rl`` gives it. Its history logs per step
  ``time/generation`` (rollout: prompt tokenisation, sampling, stop-token
  cut, decoding), ``time/forward`` (policy + value and reference
  log-probabilities, no grad), ``time/reward`` (every reward function,
  called TRL-style), ``time/optimization`` (scores, KL, GAE, whitening and
  ``num_ppo_epochs`` of minibatch updates) and ``time/step`` (all of it plus
  the step's metrics); these are the figures.
* GRPO and RLOO: TRL's ``GRPOTrainer`` / ``RLOOTrainer`` through
  :func:`storyrl.training.storyteller.rl.trl_trainers.train_trl` (story monitor,
  history). Generation is the trainer's ``_generate`` (prompt tokenisation,
  ``generate``, decoding) and the forwards are the calls of
  ``_get_per_token_logps_and_entropies`` made without grad (the reference
  model's with ``beta > 0``; old-policy ones only when TRL needs them), both
  timed by wrapping the class's methods for the run; the reward is the time
  inside the reward functions (each wrapped by a timer that keeps its
  ``__name__``, inside storyrl's story monitor); the step is wall time from
  a ``TrainerCallback``'s ``on_step_begin`` to ``on_step_end`` (rollout,
  loss forward/backward, gradient clipping and the optimizer step). TRL's
  own ``step_time`` metric leaves the optimizer step out, so it is not used.

For all, "optimisation" below is the step minus generation, forwards and
reward: the loss forwards and backwards, the optimizer, and each trainer's
bookkeeping (advantages, metrics, TRL's padding and gathering, storyrl's
story statistics). The first ``--warmup`` steps are not counted; the
figures are means over the next ``--steps``. Each algorithm's defaults are
kept where they define its cost (PPO: ``num_ppo_epochs`` 4, one minibatch,
KL to a frozen reference copy; GRPO: one optimisation pass per generation),
except GRPO's ``beta``: TRL 1.16 defaults to 0 (no reference model); the
benchmark uses ``--grpo-beta 0.04`` (TRL's earlier default; RLOO's too) so
every algorithm pays for a reference forward. Gradient checkpointing is off
(``--gradient-checkpointing`` turns it on for all). All score ``--batch``
stories per step: GRPO/RLOO as ``--batch / --generations`` prompts ×
``--generations`` completions, PPO as ``--batch`` prompts with one
completion each.

Plain generate
--------------
Right after each timed step (outside its timed phases) the step's
``generate`` calls are replayed with plain ``model.generate`` on the run's
model: same prompts, batch, padding and sampling settings, exactly the
decoding steps the RL call made, KV cache on, eval mode; LoRA unmerged (as
peft has it) and merged (the reference); the RNG is restored afterwards
(:mod:`rl_generate`, which documents the details). Per algorithm
``generation_over_generate`` is the median over the timed steps of (the
generation phase / its merged replay), paired step by step; target ≤ 1.25.
``--merge-adapters-for-sampling off`` runs the RL sampling through peft's
unmerged layers (storyrl before issue 32).

On CUDA the GRPO timers synchronise the device. PPO's own laps do not:
GPU work still queued at the end of one phase (e.g. the no-grad forwards)
is counted in the next phase that waits for the GPU (the reward, whose
values come back to the host). ``torch.cuda.max_memory_allocated`` is
recorded per algorithm (reset to the memory in use just before training
starts; the reward models are on the GPU for both).

Reward
------
``--reward dhm`` (default): the composite ``dhm`` reward over grounding
(tanh GROOViST), coherence (RoViST-C) and repetition (RoViST-NR) against
each sequence's human story, scored once per story id and cached, as in
training. GROOViST runs on a tiny random-weight CLIP (``tests/tiny_models``
``save_tiny_clip``) over grid regions (3×3 + the whole image) of real PNG
files, 5 per sequence, different for every sequence, so that image
embeddings are computed for every new sequence as in a first epoch;
concreteness weights and pronouns from ``../shared/data/groovist`` when that
folder exists (else no weighting and a short pronoun list). RoViST-C runs a
tiny random ALBERT (``save_coherence_model``, hidden 32 × 2 layers).
spaCy's trained ``en_core_web_*`` pipelines cannot be installed here (not
on the package registry), so noun phrases go through storyrl's
``PhraseExtractor`` with a spaCy pipeline of ``en_core_web_sm``'s shape and
random weights (:class:`SpacyShapedPhrases`: the time is spaCy's, the
phrases come from a regular expression over the parsed sentence); the
transformer ``en_core_web_trf`` (the authors') is not measured.
``--noun-phrases regex`` uses the regular expression alone (no spaCy
time). ``--reward repetition`` times the model-free RoViST-NR reward alone.

Reward preparation
------------------
``--prepare both`` (default) runs each algorithm twice in the same run:
without ``prepare_rewards`` (the reward embeds a new sequence's image
regions and scores its human story inside the step that meets it), and
with it (``RLConfig.prepare_rewards``, as ``storyrl train rl`` does by
default: :func:`storyrl.training.storyteller.rl.train.prepare_rewards` embeds every
dataset row's regions and scores the human stories before the first step;
its time is printed and not part of any step).

Policy and data
---------------
Random weights (hubs are unreachable): a LLaMA built from a config
(``--policy-size tiny``: the tests' hidden 32 × 2 layers; ``small``: hidden
256 × 4 layers, MLP 1024, 4.0 M parameters) with a word-level
tokenizer over the prompts and stories (about 100 words, so the output
softmax is far smaller than a real LM's). A random policy writes word soup
without sentence ends, which the coherence reward cannot score (one
sentence) and which would make every d_HM reward None; so the policy is
first fitted for a few seconds (untimed) on synthetic stories (lower-cased,
tokenised, VIST-like "the red dog ran to the park . ..."), enough to write
sentence-shaped text. The dataset has one such human story and 5 images per
sequence; the prompt is the d_HM P3 visual prompt (the RL config's default).

Exit status: 0, or 1 if a run fails; 2 for missing packages. PASS/FAIL
against the targets (reward ≤ 10 % of the step; generation ≤ 1.25 × plain
generate, per algorithm) is printed and written to ``--json``
(``generation_over_generate``: per algorithm, its worst run) but does not
change the exit status.

Usage::

    python benchmarks/rl_step.py [--steps 8] [--warmup 1] [--sequences N] [--batch 8] [--generations 4]
        [--max-new-tokens 32] [--policy-size tiny|small] [--reward dhm|repetition|both]
        [--algorithms ppo,grpo,rloo] [--ppo-epochs 4] [--grpo-beta 0.04] [--device cpu|cuda] [--threads 1]
        [--sft-steps 150] [--json OUT] [--prepare both|on|off] [--noun-phrases spacy-sm-shape|regex]
        [--lora on|off] [--gradient-checkpointing] [--merge-adapters-for-sampling on|off] [--generate-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tiny_models: save_tiny_clip, save_coherence_model, chat_tokenizer, ...
GROOVIST_DATA = REPO.parent / "shared" / "data" / "groovist"

TARGET = 0.10  # reward time / step time
GENERATION_TARGET = 1.25  # generation phase / plain generate on the same model, batch and lengths (issue 32)
PHASES = ("generation", "forward", "reward", "optimisation")

# -- synthetic VIST-like stories (lower-cased, tokenised) -----------------------------------

DETS = ["the", "a", "my", "our"]
ADJS = ["red", "big", "small", "old", "happy", "green", "little", "blue"]
NOUNS = ["dog", "cat", "park", "ball", "sun", "sea", "beach", "car", "tree", "cake", "sky", "house", "boy",
         "girl", "family", "friends", "party", "street", "city", "church", "snow", "garden", "bird", "boat"]
VERBS = ["saw", "found", "visited", "liked", "watched", "painted", "left", "loved"]
INTRANSITIVE = ["ran", "walked", "played", "sat", "waited", "laughed"]
PREPS = ["to", "in", "at", "near", "under", "by"]
TEMPLATES = [
    "{det} {adj} {noun} {verb} {det2} {noun2} .",
    "{det} {noun} {intr} {prep} the {adj} {noun2} .",
    "we {verb} {det} {adj} {noun} .",
    "it was a {adj} day at the {noun} .",
    "then {det} {noun} {intr} {prep} {det2} {noun2} .",
]
IMAGES_PER_SEQUENCE = 5
POLICY_SIZES = {
    "tiny": None,  # tests/tiny_models.LLAMA_SIZE
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024, max_position_embeddings=512),
}


def story(rng, sentences: int = IMAGES_PER_SEQUENCE) -> str:
    out = []
    for _ in range(sentences):
        template = TEMPLATES[rng.integers(len(TEMPLATES))]
        pick = lambda words: words[rng.integers(len(words))]  # noqa: E731
        out.append(template.format(det=pick(DETS), det2=pick(DETS), adj=pick(ADJS), noun=pick(NOUNS),
                                   noun2=pick(NOUNS), verb=pick(VERBS), intr=pick(INTRANSITIVE), prep=pick(PREPS)))
    return " ".join(out)


class NounPhrases:
    """Stand-in for GROOViST's spaCy noun-phrase extractor (no English
    pipeline can be installed offline): a determiner, adjectives and a noun
    of the benchmark's word lists make one phrase, in story order. Far
    cheaper than spaCy."""

    _pattern = re.compile(r"\b(?:(?:%s) )?(?:(?:%s) )*(?:%s)\b" % ("|".join(DETS), "|".join(ADJS), "|".join(NOUNS)))

    def extract(self, stories):
        return [self._pattern.findall(s.lower()) if isinstance(s, str) else [] for s in stories]


class SpacyShapedPhrases:
    """GROOViST's extraction path at spaCy's cost: storyrl's
    :class:`~storyrl.noun_phrases.PhraseExtractor` (sentence split,
    placeholders, per-sentence cache, one ``nlp.pipe`` over the new
    sentences) with a real spaCy pipeline of ``en_core_web_sm``'s shape --
    spaCy's own "efficiency" English config (a shared CNN tok2vec, width
    96, hash-embedding rows 5000/1000/2500/2500, then tagger and parser, the
    components noun chunks need) -- with random weights: no trained English
    pipeline can be installed here. A random parser's noun chunks mean
    nothing, so each parsed sentence's phrases are taken by the regular
    expression of :class:`NounPhrases` from the parsed text (the scores stay
    those of the regex extractor; the time is spaCy's)."""

    def __init__(self) -> None:
        from storyrl.noun_phrases import PhraseExtractor

        self.inner = PhraseExtractor(nlp=_RegexChunked(_random_sm_pipeline()))

    def extract(self, stories):
        return self.inner.extract(list(stories))


def _random_sm_pipeline():
    import spacy
    from spacy.cli.init_config import init_config
    from spacy.training import Example

    config = init_config(lang="en", pipeline=["tagger", "parser"], optimize="efficiency")
    nlp = spacy.util.load_model_from_config(config, auto_fill=True, validate=True)
    example = Example.from_dict(nlp.make_doc("the red dog ran to the park ."), {
        "tags": ["DT", "JJ", "NN", "VBD", "IN", "DT", "NN", "."], "heads": [2, 2, 3, 3, 3, 6, 4, 3],
        "deps": ["det", "amod", "nsubj", "ROOT", "prep", "det", "pobj", "punct"]})
    nlp.initialize(lambda: [example])  # labels only: the weights stay random
    return nlp


class _RegexChunked:
    """``pipe`` runs the spaCy pipeline, then gives each parsed sentence the
    regex's phrases as its ``noun_chunks``."""

    def __init__(self, nlp) -> None:
        self.nlp = nlp

    def pipe(self, texts, batch_size=64):
        from types import SimpleNamespace

        for doc in self.nlp.pipe(texts, batch_size=batch_size):
            chunks = [SimpleNamespace(text=m) for m in NounPhrases._pattern.findall(doc.text.lower())]
            yield SimpleNamespace(noun_chunks=chunks)


NP_EXTRACTORS = {"spacy-sm-shape": SpacyShapedPhrases, "regex": NounPhrases}


# -- arguments ------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per algorithm (default 8)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--batch", type=int, default=8, help="stories scored per step (default 8)")
    p.add_argument("--generations", type=int, default=4, help="GRPO completions per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="per completion (default 32)")
    p.add_argument("--policy-size", choices=sorted(POLICY_SIZES), default="tiny")
    p.add_argument("--reward", choices=["dhm", "repetition", "both"], default="dhm",
                   help="the composite d_HM reward (default), RoViST-NR alone, or both one after the other")
    p.add_argument("--algorithms", default="ppo,grpo,rloo", help="comma-separated: ppo, grpo, rloo (default all)")
    p.add_argument("--ppo-epochs", type=int, default=4, help="PPO epochs per rollout (storyrl's default 4)")
    p.add_argument("--grpo-beta", type=float, default=0.04,
                   help="GRPO and RLOO KL coefficient (default 0.04: a reference forward as PPO has; TRL 1.16's "
                        "GRPO default is 0)")
    p.add_argument("--lora", choices=["off", "on"], default="on",
                   help="LoRA adapters on the policy (r 16, alpha 32, dropout 0.05 on q/k/v/o, as the shipped "
                        "configs; default on), or full fine-tuning")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing on for every algorithm (default off)")
    p.add_argument("--merge-adapters-for-sampling", choices=["on", "off"], default="on",
                   help="RLConfig merge_adapters_for_sampling (default on, storyrl's default; off: sample through "
                        "peft's unmerged layers, as before issue 32)")
    p.add_argument("--generate-repeats", type=int, default=3,
                   help="plain generate replays per timed step and variant, median taken (default 3)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: tiny models gain nothing from more; 0 keeps torch's default)")
    p.add_argument("--sequences", type=int, default=None,
                   help="image sequences in the dataset (default: batch x (warmup + steps), so every step meets "
                        "new ones, as in a first epoch; e.g. --sequences 8 --warmup 4 makes every timed step a "
                        "revisit, as in later epochs, with the reward's caches warm)")
    p.add_argument("--sft-steps", type=int, default=150, help="untimed fitting of the policy to stories (default 150)")
    p.add_argument("--prepare", choices=["both", "on", "off"], default="both",
                   help="run each algorithm with the rewards prepared before training (RLConfig prepare_rewards: "
                        "the images embedded, d_HM's human stories scored), without, or both side by side (default)")
    p.add_argument("--noun-phrases", choices=sorted(NP_EXTRACTORS), default="spacy-sm-shape",
                   help="GROOViST's NP extraction: spaCy at en_core_web_sm's shape with random weights (default), "
                        "or the cheap regex stand-in")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in RUNNERS]
    if bad or not args.algorithms:
        p.error(f"--algorithms: unknown {bad}; use ppo, grpo, rloo")
    if args.generate_repeats < 1:
        p.error("--generate-repeats must be >= 1")
    if args.batch % args.generations:
        p.error(f"--batch ({args.batch}) must be divisible by --generations ({args.generations})")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.sequences is None:
        args.sequences = args.batch * (args.warmup + args.steps)
    elif args.sequences < max(args.batch // args.generations, 1):
        p.error("--sequences must be at least the prompts of one step")
    return args


# -- assets ---------------------------------------------------------------------------------


def write_images(directory: Path, sequences: int, seed: int = 0) -> list[list[str]]:
    """``IMAGES_PER_SEQUENCE`` distinct small PNGs (colour gradients plus
    noise, 64×48) per sequence."""
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, 64)[None, :, None]
    y = np.linspace(0, 1, 48)[:, None, None]
    out = []
    for s in range(sequences):
        paths = []
        for k in range(IMAGES_PER_SEQUENCE):
            base = rng.uniform(0, 255, size=3)
            pixels = (base * (0.4 + 0.6 * x) * (0.5 + 0.5 * y) + rng.normal(0, 12, size=(48, 64, 3))) % 256
            path = directory / f"seq{s}_{k}.png"
            Image.fromarray(pixels.astype("uint8")).save(path)
            paths.append(str(path))
        out.append(paths)
    return out


def build_policy(directory: Path, texts: list[str], stories: list[str], prompt: str, size: str, sft_steps: int,
                 device: str = "cpu", seed: int = 0) -> tuple[str, float, int]:
    """The random LLaMA and its chat tokenizer, fitted for ``sft_steps`` on
    ``prompt`` + a story + EOS so that it writes sentences (module docs);
    saved to ``directory``. Returns the directory, the last loss and the
    number of parameters."""
    import torch
    from tiny_models import chat_tokenizer, tiny_llama
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chat_tokenizer(texts)
    if POLICY_SIZES[size] is None:
        model = tiny_llama(tokenizer, seed)
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                                             **POLICY_SIZES[size]))
    head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    rows = [head_ids + tokenizer(s, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for s in stories]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, len(head_ids) : len(r)] = torch.tensor(r[len(head_ids):])
    mask = (labels != -100) | (torch.arange(width) < len(head_ids))
    ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(sft_steps):
        pick = torch.randint(len(rows), (16,), generator=gen).to(device)
        loss = model(input_ids=ids[pick], attention_mask=mask[pick].long(), labels=labels[pick]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory), float(loss), sum(p.numel() for p in model.parameters())


def build_assets(root: Path, args) -> dict:
    """Images, the JSONL records, the policy and the reward models in ``root``."""
    import numpy as np
    from tiny_models import albert_tokenizer, save_coherence_model, save_tiny_clip

    rng = np.random.default_rng(0)
    sequences = args.sequences
    images = write_images(root / "images", sequences)
    humans = [story(rng) for _ in range(sequences)]
    data = root / "data.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for k, (paths, text) in enumerate(zip(images, humans)):
            f.write(json.dumps({"story_id": f"seq{k}", "story": text, "images": paths}) + "\n")
    prompt = _prompt_text(IMAGES_PER_SEQUENCE)
    vocabulary = " ".join([*DETS, *ADJS, *NOUNS, *VERBS, *INTRANSITIVE, *PREPS, "we it was day then ."])
    t0 = time.perf_counter()
    fit_rng = np.random.default_rng(1)  # the policy does not depend on --sequences
    policy, sft_loss, n_params = build_policy(root / "policy", [prompt, vocabulary],
                                              [story(fit_rng) for _ in range(512)], prompt, args.policy_size,
                                              args.sft_steps, args.device)
    sft_s = time.perf_counter() - t0
    assets = {"root": root, "data": str(data), "policy": policy, "sft_s": sft_s, "sft_loss": sft_loss,
              "policy_parameters": n_params,
              "sample_story": _sample(policy, prompt), "rewards": {"repetition": ["repetition"]}, "weighting": "n/a"}
    if args.reward in ("dhm", "both"):
        clip = save_tiny_clip(root / "clip")
        coherence = save_coherence_model(root / "coherence", albert_tokenizer([vocabulary, *humans]), seed=0,
                                         size="small", head_scale=20)
        grounding = {"clip_model": clip, "clip_pretrained": None, "regions": "grid", "device": args.device}
        if (GROOVIST_DATA / "concreteness_ratings.csv").is_file() and (GROOVIST_DATA / "all_pronouns.txt").is_file():
            grounding.update(concreteness=str(GROOVIST_DATA / "concreteness_ratings.csv"),
                             pronouns=str(GROOVIST_DATA / "all_pronouns.txt"))
            assets["weighting"] = "concreteness (shared data)"
        else:
            pronouns = root / "pronouns.txt"
            pronouns.write_text("it\nwe\nthey\nhe\nshe\n")
            grounding.update(weighting="none", pronouns=str(pronouns))
            assets["weighting"] = "none"
        assets["rewards"]["dhm"] = [{"reward": "dhm", "rewards": {
            "grounding": grounding, "coherence": {"model": coherence, "device": args.device}}}]
    return assets


def _sample(policy: str, prompt: str) -> str:
    """One sampled completion of the fitted policy (printed as a sanity check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**ids, do_sample=True, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def _prompt_text(n: int) -> str:
    """The P3 visual prompt as the RL config fills it (count as a word)."""
    from storyrl.generators.prompting import PromptingConfig, PromptingGenerator

    return PromptingGenerator(PromptingConfig(prompt="P3")).prompt_text(n)


# -- configs and rewards ----------------------------------------------------------------------


def rl_config(assets: dict, args, reward: str, algorithm: str, out: Path, prepare: bool = False):
    from storyrl.training.storyteller.rl.config import RLConfig

    steps = args.warmup + args.steps
    mapping = {
        "algorithm": algorithm, "model": assets["policy"], "data": assets["data"], "output_dir": str(out),
        "rewards": assets["rewards"][reward], "max_steps": steps, "seed": 0, "prompt": "P3", "report_to": "none",
        "prepare_rewards": prepare, "merge_adapters_for_sampling": args.merge_adapters_for_sampling == "on",
    }
    if args.lora == "on":
        mapping["lora"] = {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.05,
                           "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    if algorithm == "ppo":
        mapping["ppo"] = {"per_device_train_batch_size": args.batch, "response_length": args.max_new_tokens,
                          "num_ppo_epochs": args.ppo_epochs, "save_steps": None, "logging_steps": 1,
                          "gradient_checkpointing": args.gradient_checkpointing}
    else:
        mapping[algorithm] = {"per_device_train_batch_size": args.batch, "num_generations": args.generations,
                              "max_completion_length": args.max_new_tokens, "beta": args.grpo_beta,
                              "logging_steps": 1, "save_strategy": "no",
                              "gradient_checkpointing": args.gradient_checkpointing}
        if args.device == "cpu":
            mapping[algorithm].update(use_cpu=True, bf16=False)
    return RLConfig.from_mapping(mapping)


def build_rewards(config, noun_phrases: str = "regex"):
    """The config's rewards, set up as ``storyrl train rl`` does, with the
    ``--noun-phrases`` extractor in GROOViST. Models and embedding caches
    are shared per process: they are released first, so each run starts
    cold (a run does not reuse the regions an earlier run embedded)."""
    from storyrl.models.runtime import release_models
    from storyrl.text import clear_caches

    release_models()
    clear_caches()
    rewards = config.build_rewards()
    for reward in rewards:
        grounding = getattr(reward, "component_rewards", {}).get("grounding")
        if grounding is not None:  # before setup, which otherwise requires the spaCy pipeline
            grounding._extractor = NP_EXTRACTORS[noun_phrases]()
        reward.setup()
    return rewards


def load(config, rewards: list) -> tuple:
    """The policy and the dataset, then the rewards prepared over the
    dataset when the config says so, as ``storyrl train rl`` does; returns
    them and the seconds the preparation took (None when off)."""
    from storyrl.training.storyteller.rl.data import build_dataset
    from storyrl.training.storyteller.rl.policy import load_policy
    from storyrl.training.storyteller.rl.train import prepare_rewards

    kind = config.policy_kind()
    policy = load_policy(config, kind)
    dataset = build_dataset(config, kind, policy.processing_class)
    t0 = time.perf_counter()
    done = prepare_rewards(config, rewards, dataset, progress=False)
    return policy, dataset, None if done is None else time.perf_counter() - t0


# -- timing helpers ---------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class Clock:
    """Seconds per phase of the current step."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.phases: dict[str, float] = {}

    @contextmanager
    def timing(self, phase: str):
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0


class TimedReward:
    """A reward function whose calls count as the clock's ``reward`` phase
    and each leave a record in ``calls``: the call's seconds and, for a
    composite reward, the seconds of each component's ``score`` on the
    completions and on the human stories (``<component> (human)``). TRL and
    PPO see the reward's ``__name__``."""

    def __init__(self, reward, clock: Clock, calls: list[dict]) -> None:
        self.reward, self.clock, self.calls = reward, clock, calls
        self.__name__ = getattr(reward, "__name__", type(reward).__name__)
        self._human = False
        for name, component in getattr(reward, "component_rewards", {}).items():
            component.score = self._timed_score(name, component.score)
            extractor = getattr(component, "_extractor", None)
            if extractor is not None:  # GROOViST's NP extraction, part of its time
                extractor.extract = self._timed_score(f"{name}: noun phrases", extractor.extract)
        if hasattr(reward, "_human"):
            reward._human = self._in_human(reward._human)

    def _timed_score(self, name: str, score):
        def inner(*a, **kw):
            key = f"{name} (human)" if self._human else name
            t0 = time.perf_counter()
            try:
                return score(*a, **kw)
            finally:
                record = self.calls[-1] if self.calls else {}
                record[key] = record.get(key, 0.0) + time.perf_counter() - t0

        return inner

    def _in_human(self, method):
        def inner(*a, **kw):
            self._human = True
            try:
                return method(*a, **kw)
            finally:
                self._human = False

        return inner

    def __call__(self, *a, **kw):
        self.calls.append({})
        t0 = time.perf_counter()
        try:
            with self.clock.timing("reward"):
                return self.reward(*a, **kw)
        finally:
            self.calls[-1]["total"] = time.perf_counter() - t0


def step_callback(clock: Clock, steps: list[dict], recorder=None):
    """A TrainerCallback recording each optimisation step's wall time and
    the clock's phases during it (and telling ``recorder`` where each step
    starts)."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if recorder is not None:
                recorder.next_step()
            _sync(clock.device)
            clock.phases = {}
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(clock.device)
            steps.append({"step": time.perf_counter() - self.t0, **clock.phases})
            if recorder is not None:  # after the step's clock: plain generate on its inputs
                recorder.step_done(kwargs["model"])

    return StepTimes()


@contextmanager
def patched(cls, name: str, wrapper):
    original = vars(cls)[name]
    setattr(cls, name, wrapper(original))
    try:
        yield
    finally:
        setattr(cls, name, original)


# -- the two algorithms -----------------------------------------------------------------------


def _reset_peak(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


def run_ppo(assets: dict, args, reward: str, out: Path, prepare: bool) -> tuple:
    """Per timed step: step, generation, forward, reward, optimisation
    (PPO's own ``time/*`` laps); the timed reward calls' records
    (:class:`TimedReward`); the seconds of the rewards' preparation; plain
    ``generate`` on the run's model next to the generation phase
    (:func:`rl_generate.summary`)."""
    from rl_generate import GenerateRecorder, summary

    from storyrl.training.storyteller.rl.policy import lora_config
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    config = rl_config(assets, args, reward, "ppo", out, prepare)
    calls: list[dict] = []
    # A CPU clock: no device synchronisation added inside PPO's own laps.
    plain = build_rewards(config, args.noun_phrases)
    policy, dataset, prepare_s = load(config, plain)
    rewards = [TimedReward(r, Clock("cpu"), calls) for r in plain]
    trainer = PPOTrainer(model=policy.model, reward_funcs=rewards, args=config.ppo, train_dataset=dataset,
                         processing_class=policy.processing_class, peft_config=lora_config(config, policy.kind),
                         reward_weights=config.reward_weights)
    import tqdm.auto

    def quiet(tqdm):  # PPO's progress bar
        return lambda *a, **kw: tqdm(*a, **{**kw, "disable": True})

    def counted(step):  # the recorder learns where each PPO step starts, and replays it after its laps
        def inner(self, *a, **kw):
            recorder.next_step()
            out = step(self, *a, **kw)
            recorder.step_done(self.policy)
            return out

        return inner

    recorder = GenerateRecorder(args.device, args.warmup, args.generate_repeats)
    _reset_peak(args.device)
    with patched(tqdm.auto, "tqdm", quiet), patched(PPOTrainer, "_step", counted), recorder.recording():
        result = trainer.train()
    steps = []
    for h in result.history[args.warmup:]:
        row = {"step": h["time/step"], "generation": h["time/generation"], "forward": h["time/forward"],
               "reward": h["time/reward"], "ppo_optimization": h["time/optimization"]}
        steps.append(_with_rest(row, h))
    recorder.merged_after_run(trainer.policy)
    return steps, calls[args.warmup:], prepare_s, summary(recorder, [s["generation"] for s in steps])


def run_trl(algorithm: str, assets: dict, args, reward: str, out: Path, prepare: bool) -> tuple:
    """GRPO or RLOO (TRL's trainer through ``train_trl``): as :func:`run_ppo`."""
    import torch
    import trl
    from rl_generate import GenerateRecorder, summary

    from storyrl.training.storyteller.rl.trl_trainers import train_trl

    trainer_class = trl.GRPOTrainer if algorithm == "grpo" else trl.RLOOTrainer
    config = rl_config(assets, args, reward, algorithm, out, prepare)
    clock = Clock(args.device)
    calls: list[dict] = []
    plain = build_rewards(config, args.noun_phrases)
    policy, dataset, prepare_s = load(config, plain)
    rewards = [TimedReward(r, clock, calls) for r in plain]
    steps: list[dict] = []

    def timed(phase, only_without_grad=False):
        def wrap(method):
            def inner(*a, **kw):
                if only_without_grad and torch.is_grad_enabled():
                    return method(*a, **kw)
                with clock.timing(phase):
                    return method(*a, **kw)

            return inner

        return wrap

    recorder = GenerateRecorder(args.device, args.warmup, args.generate_repeats)
    _reset_peak(args.device)
    with patched(trainer_class, "_generate", timed("generation")), \
            patched(trainer_class, "_get_per_token_logps_and_entropies", timed("forward", only_without_grad=True)), \
            recorder.recording():
        trainer = train_trl(config, policy, dataset, rewards, progress=False,
                            callbacks=[step_callback(clock, steps, recorder)])
    history = [h for h in trainer.state.log_history if "reward" in h]
    out_steps = []
    for row, h in zip(steps[args.warmup:], history[args.warmup:]):
        out_steps.append(_with_rest({"step": row["step"], **{p: row.get(p, 0.0) for p in PHASES[:3]}}, h))
    recorder.merged_after_run(trainer.accelerator.unwrap_model(trainer.model))
    return out_steps, calls[args.warmup:], prepare_s, summary(recorder, [s["generation"] for s in out_steps])


def run_grpo(assets: dict, args, reward: str, out: Path, prepare: bool) -> tuple:
    return run_trl("grpo", assets, args, reward, out, prepare)


def run_rloo(assets: dict, args, reward: str, out: Path, prepare: bool) -> tuple:
    return run_trl("rloo", assets, args, reward, out, prepare)


RUNNERS = {"ppo": run_ppo, "grpo": run_grpo, "rloo": run_rloo}


def _with_rest(row: dict, logged: dict) -> dict:
    row["optimisation"] = row["step"] - sum(row[p] for p in PHASES[:3])
    row["logged_reward"] = logged.get("reward")
    row["completion_tokens"] = logged.get("story/tokens_mean", logged.get("completions/mean_length"))
    row["unscorable_frac"] = next((v for k, v in logged.items() if k.endswith("/unscorable_frac")
                                   and k.count("/") == 1), None)  # the reward's own, not a component's
    return row


def summarise(name: str, steps: list[dict], calls: list[dict], peak: float | None) -> dict:
    n = len(steps)
    mean = {k: sum(s[k] for s in steps) / n for k in ("step", *PHASES)}
    share = {p: mean[p] / mean["step"] for p in PHASES}
    verdict = "PASS" if share["reward"] <= TARGET else "FAIL"
    rewards = [s["logged_reward"] for s in steps if isinstance(s.get("logged_reward"), (int, float))]
    tokens = [s["completion_tokens"] for s in steps if isinstance(s.get("completion_tokens"), (int, float))]
    unscorable = [s["unscorable_frac"] for s in steps if isinstance(s.get("unscorable_frac"), (int, float))]
    parts = sorted({k for c in calls for k in c})
    breakdown = {k: sum(c.get(k, 0.0) for c in calls) / max(len(calls), 1) for k in parts}
    summary = dict(algorithm=name, steps=n, mean_s=mean, share=share, verdict=verdict, peak_cuda_mib=peak,
                   reward_breakdown_s=breakdown, per_step=steps, reward_calls=calls,
                   mean_reward=sum(rewards) / len(rewards) if rewards else None,
                   mean_completion_tokens=sum(tokens) / len(tokens) if tokens else None,
                   unscorable_frac=sum(unscorable) / len(unscorable) if unscorable else None)
    if name == "ppo":
        summary["ppo_logged_optimization_s"] = sum(s["ppo_optimization"] for s in steps) / n
    return summary


def side_by_side(results: list[dict]) -> None:
    """Each algorithm's reward share without and with the rewards prepared."""
    print("\nside by side (same run): reward share of the step, without -> with prepare_rewards")
    for name in dict.fromkeys(r["algorithm"] for r in results):
        runs = {r["prepared"]: r for r in results if r["algorithm"] == name}
        if len(runs) < 2:
            continue
        off, on = runs[False], runs[True]
        print(f"  {name.upper():5s} step {1e3 * off['mean_s']['step']:.0f} -> {1e3 * on['mean_s']['step']:.0f} ms, "
              f"reward {1e3 * off['mean_s']['reward']:.0f} -> {1e3 * on['mean_s']['reward']:.0f} ms, share "
              f"{100 * off['share']['reward']:.1f} % ({off['verdict']}) -> {100 * on['share']['reward']:.1f} % "
              f"({on['verdict']}); preparing took {on['prepare_s']:.2f} s once")


def report(summary: dict) -> None:
    name, m, s = summary["algorithm"], summary["mean_s"], summary["share"]
    peak = f", peak CUDA {summary['peak_cuda_mib']:.0f} MiB" if summary["peak_cuda_mib"] is not None else ""
    prepared = (f", rewards prepared before training in {summary['prepare_s']:.2f} s" if summary.get("prepared")
                else ", rewards not prepared")
    print(f"\n{summary['reward']} / {name.upper()}{prepared}: {m['step']:.3f} s/step (mean of {summary['steps']}; "
          f"run incl. set-up {summary['run_s']:.0f} s){peak}")
    for p in PHASES:
        print(f"  {p:13s} {m[p]:8.3f} s  {100 * s[p]:5.1f} %")
    b = summary["reward_breakdown_s"]
    parts = [k for k in b if k != "total"]
    if parts:
        print("  reward calls: " + ", ".join(f"{k} {b[k]:.3f} s" for k in parts)
              + f" (of {b.get('total', math.nan):.3f} s; '(human)': the first scoring of a sequence's human story, "
              "which also embeds its image regions)")
    extra = f"; PPO's own time/optimization {summary['ppo_logged_optimization_s']:.3f} s" if name == "ppo" else ""
    tokens, reward = summary["mean_completion_tokens"], summary["mean_reward"]
    unscorable = summary["unscorable_frac"]
    print(f"  mean reward {'n/a' if reward is None else f'{reward:.3f}'}, unscorable "
          f"{'n/a' if unscorable is None else f'{100 * unscorable:.0f} %'}, mean completion tokens "
          f"{'n/a' if tokens is None else f'{tokens:.1f}'}{extra}")
    print(f"  reward share {100 * s['reward']:.1f} % of the step -> {summary['verdict']} "
          f"(target <= {100 * TARGET:.0f} %)")
    report_generate(summary.get("generate"))


def report_generate(g: dict | None) -> None:
    """The generation phase next to plain generate (rl_generate.compare)."""
    if not g:
        return
    if "error" in g:
        print(f"  plain generate: {g['error']}")
        return
    ms = g["ms_per_token"]
    variants = [v for v in ("plain", "unmerged", "merged") if v in ms]
    print(f"  generation vs plain generate ({g['steps']} timed steps, rows x decoding steps "
          f"{g['rows'][0][0]} x {[d for step in g['decoding_steps'] for d in step]}, median of {g['repeats']} "
          f"replays): ms per token: RL phase {ms['generation']:.3f}, RL generate call {ms['generate_call']:.3f}, "
          + ", ".join(f"plain {v} {ms[v]:.3f}" for v in variants))
    ratio = g["generation_over_generate"]
    verdict = "PASS" if ratio <= GENERATION_TARGET else "FAIL"
    extra = (f"; vs unmerged {g['generation_over_generate_unmerged']:.2f}x, plain unmerged / merged "
             f"{g['unmerged_over_merged']:.2f}x" if "unmerged_over_merged" in g else "")
    print(f"  generation_over_generate {ratio:.2f}x (vs {g['reference']}; the generate call alone "
          f"{g['generate_call_over_generate']:.2f}x){extra} -> {verdict} (target <= {GENERATION_TARGET})")


def generation_ratios(results: list[dict]) -> dict[str, float]:
    """Per algorithm, the largest ``generation_over_generate`` of its runs."""
    out: dict[str, float] = {}
    for r in results:
        ratio = (r.get("generate") or {}).get("generation_over_generate")
        if ratio is not None:
            out[r["algorithm"]] = max(ratio, out.get(r["algorithm"], ratio))
    return out


# -- main -------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # accelerate (PPO) would take a visible GPU
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    try:
        import storyrl  # noqa: F401  (before transformers: CPU torchvision fallback)
        import torch
        import transformers
        import trl
    except ImportError as exc:
        print(f"missing package: {exc}", file=sys.stderr)
        return 2
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("storyrl", "trl", "accelerate"):  # unscorable stories are counted in the figures instead
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)

    kinds = ["dhm", "repetition"] if args.reward == "both" else [args.reward]
    with tempfile.TemporaryDirectory(prefix="storyrl-rl-step-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        assets = build_assets(tmp, args)
        print(f"RL step benchmark: {args.policy_size} policy ({assets['policy_parameters'] / 1e6:.2f} M parameters), "
              f"batch {args.batch} stories (GRPO {args.batch // args.generations} prompts x {args.generations}), "
              f"{args.max_new_tokens} new tokens, {args.warmup} warm-up + {args.steps} timed steps, "
              f"{args.sequences} sequences, device {args.device}, {torch.get_num_threads()} torch thread(s), "
              f"noun phrases: {args.noun_phrases}, prepare_rewards: {args.prepare}")
        print(f"assets built in {time.perf_counter() - t0:.1f} s (policy fitted to stories in {assets['sft_s']:.1f} s, "
              f"loss {assets['sft_loss']:.2f}; GROOViST weighting: {assets['weighting']})")
        print(f"python {platform.python_version()}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, trl {trl.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"a sampled story of the fitted policy: {assets['sample_story']!r}")
        results = []
        failed = False
        variants = {"both": [False, True], "on": [True], "off": [False]}[args.prepare]
        for kind in kinds:
            pair = []
            for name in args.algorithms:
                for prepare in variants:
                    t0 = time.perf_counter()
                    label = f"{name}{'_prepared' if prepare else ''}"
                    try:
                        steps, calls, prepare_s, generate = RUNNERS[name](assets, args, kind,
                                                                          tmp / f"out_{kind}_{label}", prepare)
                    except Exception as exc:  # report the other runs' figures anyway
                        import traceback

                        traceback.print_exc()
                        print(f"{kind} / {label}: failed: {type(exc).__name__}: {exc}")
                        failed = True
                        continue
                    summary = {"reward": kind, **summarise(name, steps, calls, _peak_mib(args.device)),
                               "prepared": prepare, "prepare_s": prepare_s, "run_s": time.perf_counter() - t0,
                               "generate": generate}
                    report(summary)
                    if prepare == variants[-1]:
                        pair.append(summary)
                    results.append(summary)
            if len(variants) == 2:
                side_by_side([r for r in results if r["reward"] == kind])
            if len(pair) == 2:
                a, b = pair
                print(f"\n{kind}: step time {a['algorithm'].upper()} / {b['algorithm'].upper()} "
                      f"{a['mean_s']['step'] / b['mean_s']['step']:.2f}x; reward time "
                      f"{a['mean_s']['reward'] / b['mean_s']['reward']:.2f}x")
                if a["peak_cuda_mib"] is not None:
                    print(f"peak CUDA memory {a['algorithm'].upper()} {a['peak_cuda_mib']:.0f} MiB, "
                          f"{b['algorithm'].upper()} {b['peak_cuda_mib']:.0f} MiB")
        ratios = generation_ratios(results)
        if ratios:
            print("\ngeneration_over_generate (worst run per algorithm): "
                  + ", ".join(f"{k.upper()} {v:.2f}x" for k, v in ratios.items())
                  + f" -> {'PASS' if max(ratios.values()) <= GENERATION_TARGET else 'FAIL'} "
                  f"(target <= {GENERATION_TARGET}); load average now "
                  f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if args.json:
            args.json.write_text(json.dumps(dict(
                generation_over_generate=ratios, generation_target=GENERATION_TARGET, lora=args.lora,
                gradient_checkpointing=args.gradient_checkpointing,
                merge_adapters_for_sampling=args.merge_adapters_for_sampling,
                generate_repeats=args.generate_repeats,
                reward=args.reward, policy_size=args.policy_size, batch=args.batch, generations=args.generations,
                max_new_tokens=args.max_new_tokens, steps=args.steps, warmup=args.warmup,
                ppo_epochs=args.ppo_epochs, grpo_beta=args.grpo_beta, device=args.device,
                threads=torch.get_num_threads(), cpus=os.cpu_count(), python=platform.python_version(),
                torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
                policy_parameters=assets["policy_parameters"], sequences=args.sequences,
                sft_loss=assets["sft_loss"], sample_story=assets["sample_story"], target=TARGET,
                prepare=args.prepare, noun_phrases=args.noun_phrases, load_average=os.getloadavg(),
                results=results, date=time.strftime("%Y-%m-%d")), indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
