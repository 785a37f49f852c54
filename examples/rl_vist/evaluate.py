"""Evaluate storytellers on the held-out sequences: d_HM to the held-out human
stories, KL to the start policy, distinct-n and story length; a Markdown
table, a JSON file and a plot.

    python examples/rl_vist/evaluate.py --heldout HELDOUT_JSONL --coherence-model DIR \\
        --policy start=DIR --policy grpo_dhm=DIR ... --out OUT_DIR
        [--runs-dir DIR] [--times TSV] [--samples 2] [--temperature 0.7] [--max-new-tokens 96] [--seed 0]

The first ``--policy`` is the start policy (the reference for KL and for the
paired differences). For every policy and held-out sequence, ``--samples``
stories are sampled from the prompt the policy was trained with (the P3
prompt with the sequence's nouns, chat-formatted), at the RL runs'
temperature, no top-k/top-p, the same random seed for every policy.

* d_HM (Surikuchi et al., 2024) along coherence (RoViST-C, the example's
  coherence model) and repetition (RoViST-NR): per generated story
  |human - model| against the sequence's human story, averaged over the
  scorable stories (both scores finite); ``storyrl.eval.dhm``. Lower is
  better. ``delta`` is the paired difference to the start policy over the
  sequences both score (per sequence, the mean over its samples), with a
  95% bootstrap interval (2000 resamples of the sequences, seeded).
* KL: per story, sum over its tokens (up to and with [EOS]) of the exact
  KL(policy || start) between the two models' next-token distributions at
  the sampling temperature, along the policy's own samples; mean over stories
  (nats). 0 for the start policy.
* noun recall: the fraction of the prompt's nouns (the stand-in for the
  images) that the story uses, mean over stories; 1 for the human stories,
  whose nouns they are. Not a reward: it shows whether RL changes how much
  the story follows what the policy was shown.
* distinct-n: distinct n-grams / n-grams pooled over all of a policy's
  stories (``storyrl.training.storyteller.rl.monitor.distinct_n``, lower-cased words);
  sentences: mean sentence count (``storyrl.text``); one-sentence: fraction of
  stories with at most one sentence (which d_HM cannot score).

With ``--runs-dir``, each policy name that has ``RUNS_DIR/NAME/history.jsonl``
also gets its training figures (mean reward, entropy, KL and distinct-2 over
the first and last 10 logged steps); with ``--times`` (lines ``name<TAB>seconds``)
the wall time of each step. Writes ``stories/NAME.jsonl``, ``results.json``,
``results.md`` and ``results.png`` to ``OUT_DIR``.

Each policy's figures (with its per-sequence d_HM, distances, scores and
sentence counts, which report.py's checks read) are kept in
``OUT_DIR/policies/NAME.json`` and read back while the settings, the
policy's directory and its files (and the start policy's) are unchanged. ``--no-report`` evaluates the given
policies into those files only (the first ``--policy`` is then only the KL
reference, unless it is the only one), so that run.sh evaluates policies in
parallel processes and reports them together afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import storyrl  # noqa: F401  (torchvision fallback before transformers)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import user_prompt

DIMENSIONS = ("coherence", "repetition")


# -- data ---------------------------------------------------------------------------------


def load_records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# -- generation and KL ---------------------------------------------------------------------


def load_policy(directory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    return model, tokenizer


def chat_prompts(tokenizer, records: Sequence[dict]) -> list[str]:
    """Each record's prompt as the RL trainers render it (chat template, generation prompt)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": user_prompt(r["noun_phrases"])}],
                                          add_generation_prompt=True, tokenize=False) for r in records]


def generate(model, tokenizer, prompts: Sequence[str], temperature: float, max_new_tokens: int, seed: int,
             batch_size: int = 64) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids up to and with the first EOS) per prompt, sampled."""
    import torch

    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        batch = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            seqs = model.generate(**batch, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
        width = batch["input_ids"].shape[1]
        for row, mask, seq in zip(batch["input_ids"], batch["attention_mask"], seqs):
            completion = seq[width:].tolist()
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
            else:
                completion = [t for t in completion if t != tokenizer.pad_token_id]
            out.append((row[mask.bool()].tolist(), completion))
    return out


def sequence_kl(model, reference, pairs: Sequence[tuple[list[int], list[int]]], temperature: float,
                pad_id: int, batch_size: int = 64) -> list[float]:
    """Per (prompt, completion): sum over the completion's positions of
    KL(model || reference) of the tempered next-token distributions (nats)."""
    import torch

    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        seqs = [p + c for p, c in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad_id)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits / temperature, -1)
            logq = torch.log_softmax(reference(input_ids=ids, attention_mask=mask).logits / temperature, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)  # KL at each position's next-token distribution
        for i, (p, c) in enumerate(chunk):
            # logits at position t predict token t+1: the completion's tokens are predicted at len(p)-1 ...
            out.append(float(kl[i, len(p) - 1 : len(p) - 1 + len(c)].sum()) if c else 0.0)
    return out


# -- scores ----------------------------------------------------------------------------------


class Scorer:
    """RoViST-C and RoViST-NR of story lists (storyrl rewards)."""

    def __init__(self, coherence_model: str) -> None:
        from storyrl.rewards import create_reward

        self.rewards = {"coherence": create_reward("coherence", model=coherence_model, mode="prefix"),
                        "repetition": create_reward("repetition")}

    def __call__(self, stories: Sequence[str]) -> dict[str, list[float]]:
        return {name: [float(v) for v in reward.score(list(stories))] for name, reward in self.rewards.items()}


def shuffled(stories: Sequence[str], seed: int) -> list[str]:
    """Each story with its sentences in another order (one-sentence stories as they are)."""
    import random

    from storyrl.text import split_sentences

    rng, out = random.Random(seed), []
    for story in stories:
        sentences = split_sentences(story)
        order = list(sentences)
        while len(set(sentences)) > 1 and order == sentences:
            rng.shuffle(order)
        out.append(" ".join(order))
    return out


def story_figures(stories: Sequence[str]) -> dict[str, float]:
    from storyrl.text import tokenize_story
    from storyrl.training.storyteller.rl.monitor import distinct_n

    words, sentences = [], []
    for story in stories:
        split = tokenize_story(story) if story.strip() else []
        sentences.append(len(split))
        words.append([w.lower() for s in split for w in s])
    n = max(len(stories), 1)
    return {"distinct_1": distinct_n(words, 1), "distinct_2": distinct_n(words, 2),
            "sentences": sum(sentences) / n, "words": sum(len(w) for w in words) / n,
            "one_sentence": sum(1 for s in sentences if s <= 1) / n}


def noun_recall(stories: Sequence[str], nouns: Sequence[Sequence[str]]) -> float:
    """Mean over stories (with nouns) of the fraction of the prompt's nouns that the story uses as a word."""
    from storyrl.text import tokenize_story

    fractions = []
    for story, wanted in zip(stories, nouns):
        if wanted:
            words = {w.lower() for s in (tokenize_story(story) if story.strip() else []) for w in s}
            fractions.append(sum(1 for n in wanted if n.lower() in words) / len(wanted))
    return sum(fractions) / len(fractions) if fractions else math.nan


def dhm_figures(human: dict[str, dict[str, float]], model: dict[str, dict[str, float]]) -> dict:
    """d_HM (storyrl.eval.dhm) of ``model`` ({metric: {row id: score}}, row ids
    ``<story_id>#<sample>``) against ``human`` ({metric: {story_id: score}})."""
    from storyrl.data import ScoreTable
    from storyrl.eval import dhm

    rows = list(next(iter(model.values())))
    human_rows = {m: {r: human[m][r.split("#")[0]] for r in rows} for m in DIMENSIONS}
    result = dhm(ScoreTable(list(rows), human_rows), ScoreTable(list(rows), model), list(DIMENSIONS))
    overall = sum(result.per_story[d] for d in result.per_story) / len(result.per_story)
    return {"n": result.n, "n_rows": len(rows), **{f"dhm_{d}": v for d, v in result.distances.items()},
            "dhm": result.d_hm, "per_sequence": per_sequence_means(result.story_ids, overall),
            "per_sequence_dims": {d: per_sequence_means(result.story_ids, result.per_story[d]) for d in DIMENSIONS}}


def per_sequence_means(rows: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    """{sequence: mean of its finite values} over row ids ``<story_id>#<sample>``; a sequence
    with no finite value is left out (the paired differences skip it)."""
    groups: dict[str, list[float]] = {}
    for row, value in zip(rows, values):
        if math.isfinite(float(value)):
            groups.setdefault(row.split("#")[0], []).append(float(value))
    return {k: sum(v) / len(v) for k, v in groups.items()}


# -- training logs -----------------------------------------------------------------------------

#: history.jsonl keys: (figure, [keys tried in order]); TRL's GRPO/RLOO and storyrl's PPO name some differently.
TRAIN_KEYS = {"reward": ["reward"], "entropy": ["entropy", "policy/entropy"], "kl": ["kl", "objective/kl"],
              "distinct_2": ["story/distinct_2"], "sentences": ["story/sentences_mean"]}


def training_figures(history_path: Path, window: int = 10) -> dict | None:
    """First / last ``window`` logged values of each of ``TRAIN_KEYS``; a DPO
    run (no sampled reward: its rows log ``loss``) is read by
    :func:`dpo_figures`."""
    if not history_path.is_file():
        return None
    rows = [json.loads(line) for line in history_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not any(isinstance(r.get("reward"), (int, float)) for r in rows) and any("loss" in r for r in rows):
        return dpo_figures(rows, window)
    rows = [r for r in rows if isinstance(r.get("reward"), (int, float))]
    if not rows:
        return None
    out: dict = {"steps": len(rows)}
    for name, keys in TRAIN_KEYS.items():
        series = [next((r[k] for k in keys if isinstance(r.get(k), (int, float))), None) for r in rows]
        series = [v for v in series if v is not None and math.isfinite(v)]
        if series:
            out[f"{name}_first"] = sum(series[:window]) / len(series[:window])
            out[f"{name}_last"] = sum(series[-window:]) / len(series[-window:])
    out["curve"] = [float(r["reward"]) if r["reward"] is not None else math.nan for r in rows]
    return out


def dpo_figures(rows: Sequence[dict], window: int = 10) -> dict | None:
    """A DPO run's figures: DPO samples nothing to train on, so its reward,
    distinct-2 and sentences are the monitoring stories' (every
    ``sample_steps``: ``rewards/<name>/mean``, ``story/...``), averaged over
    the first / last quarter of those logs (at most ``window``); no KL is
    logged, and TRL's ``entropy`` is over the pairs' tokens, not the policy's
    own stories, so it is left out. ``curve_steps``: the steps of ``curve``."""
    steps = [r for r in rows if "loss" in r and isinstance(r.get("step"), int)]
    monitored = [r for r in rows if isinstance(r.get("step"), int)
                 and any(k.startswith("rewards/") and k.endswith("/mean") for k in r)]
    if not steps or not monitored:
        return None
    reward_key = next(k for k in monitored[0] if k.startswith("rewards/") and k.endswith("/mean"))
    k = min(window, max(1, len(monitored) // 4))
    out: dict = {"steps": max(r["step"] for r in steps), "monitor": reward_key}
    for name, key in (("reward", reward_key), ("distinct_2", "story/distinct_2"), ("sentences", "story/sentences_mean")):
        series = [r[key] for r in monitored if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if series:
            out[f"{name}_first"] = sum(series[:k]) / len(series[:k])
            out[f"{name}_last"] = sum(series[-k:]) / len(series[-k:])
    out["curve"] = [float(r[reward_key]) for r in monitored]
    out["curve_steps"] = [r["step"] for r in monitored]
    return out


def read_times(path) -> dict[str, float]:
    if path is None or not Path(path).is_file():
        return {}
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            name, seconds = line.split("\t")[:2]
            out[name] = float(seconds)
    return out


# -- report ----------------------------------------------------------------------------------


def _f(value, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def markdown(results: dict) -> str:
    human = results["human"]
    lines = [
        (f"{results['label'].capitalize()} ({results['heldout']}): {results['n_sequences']} sequences x "
         f"{results['samples']} sampled stories per policy (temperature {results['temperature']}, seed "
         f"{results['seed']}). d_HM: lower is better; delta = paired difference to the start policy with a 95% "
         "bootstrap interval."),
        "",
        ("| policy | d_HM | delta d_HM [95% CI] | d_HM coh. | d_HM rep. | coherence | repetition | KL to start "
         "| distinct-1 | distinct-2 | sentences | one-sentence | noun recall |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        (f"| human ({results['label']}) | 0 | | 0 | 0 | {_f(human['coherence'])} | {_f(human['repetition'])} | | "
         f"{_f(human['distinct_1'])} | {_f(human['distinct_2'])} | {_f(human['sentences'], 2)} | "
         f"{_f(human['one_sentence'])} | 1 |"),
    ]
    for name, r in results["policies"].items():
        d = r["delta"]
        delta = "" if name == results["start"] else f"{d['delta']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
        lines.append(
            f"| {name} | {_f(r['dhm'], 4)} | {delta} | {_f(r['dhm_coherence'], 4)} | {_f(r['dhm_repetition'], 4)} | "
            f"{_f(r['coherence'])} | {_f(r['repetition'])} | {_f(r['kl'], 2)} | {_f(r['distinct_1'])} | "
            f"{_f(r['distinct_2'])} | {_f(r['sentences'], 2)} | {_f(r['one_sentence'])} | "
            f"{_f(r.get('noun_recall'))} |")
    lines += ["", (f"Coherence model check: the {results['label']} human stories score {_f(human['coherence'])}, "
                   f"the same stories with their sentences shuffled {_f(human.get('coherence_shuffled'))}.")]
    trained = {n: r for n, r in results["policies"].items() if r.get("training")}
    if trained:
        lines += ["", "Training (mean over the first / last 10 logged steps; reward = the run's own reward):", "",
                  "| run | steps | reward | entropy | KL | distinct-2 | sentences | wall time (s) |",
                  "|---|---:|---|---|---|---|---|---:|"]
        for name, r in trained.items():
            t = r["training"]

            def pair(key, digits=3, t=t):
                return f"{_f(t.get(key + '_first'), digits)} → {_f(t.get(key + '_last'), digits)}"

            lines.append(f"| {name} | {t['steps']} | {pair('reward')} | {pair('entropy', 2)} | {pair('kl')} | "
                         f"{pair('distinct_2')} | {pair('sentences', 2)} | {_f(r.get('seconds'), 0)} |")
    if any(r["training"].get("curve_steps") for r in trained.values()):
        lines += ["", ("DPO rows: no sampled training reward or KL; reward, distinct-2 and sentences are those of the "
                       "monitoring stories (sample_prompts sequences of the train data, every sample_steps steps; "
                       "first / last quarter of those logs).")]
    if results.get("times"):
        lines += ["", "Wall time of each step (s): " + ", ".join(f"{k} {v:.0f}" for k, v in results["times"].items())]
    return "\n".join(lines) + "\n"


def reward_curve(training: dict):
    """(steps, reward - its first value) of a run's training figures: a reward every step as a
    moving mean of 10 (at the window's last step); DPO's few monitoring points as they are."""
    import numpy as np

    curve = np.array(training["curve"], dtype=float)
    if training.get("curve_steps"):
        return np.array(training["curve_steps"]), curve - curve[0]
    k = min(10, len(curve))
    smooth = np.convolve(np.nan_to_num(curve, nan=np.nanmean(curve)), np.ones(k) / k, mode="valid")
    return np.arange(len(smooth)) + k, smooth - smooth[0]


def _legend_outside(ax) -> None:
    """Right of the axes, where it cannot cover a bar, a curve or a point."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def figure(results: dict):
    """The three panels of results.png (a matplotlib Figure, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(results["policies"])
    pol = results["policies"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.8), layout="constrained")
    ax = axes[0]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [pol[n]["dhm_coherence"] for n in names], 0.2, label="coherence")
    ax.bar(x, [pol[n]["dhm_repetition"] for n in names], 0.2, label="repetition")
    ax.bar(x + 0.2, [pol[n]["dhm"] for n in names], 0.2, label="d_HM (mean)", color="black")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel(f"distance to the {results['label']} human stories (lower is better)")
    ax.set_title(f"{results['label']} d_HM per dimension")
    _legend_outside(ax)
    ax = axes[1]
    for n in names:
        t = pol[n].get("training") or {}
        if not t.get("curve"):
            continue
        steps, change = reward_curve(t)
        if t.get("curve_steps"):  # DPO: the monitoring stories' reward, a few points
            ax.plot(steps, change, marker="o", ls=":", label=f"{n} (monitor)")
        else:
            ax.plot(steps, change, label=n, ls="--" if "repetition" in n else "-")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("logged step")
    ax.set_ylabel("training reward - its start (moving mean of 10)")
    ax.set_title("training reward")
    _legend_outside(ax)
    ax = axes[2]
    for n in names:
        if n == results["start"]:
            continue
        d = pol[n]["delta"]
        ax.errorbar(pol[n]["kl"], d["delta"], yerr=[[d["delta"] - d["low"]], [d["high"] - d["delta"]]],
                    fmt="s" if "repetition" in n else "o", capsize=3, label=n)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("KL to the start policy (nats per story)")
    ax.set_ylabel("delta d_HM vs start (95% CI)")
    ax.set_title(f"{results['label']} improvement vs drift")
    _legend_outside(ax)
    return fig


def plot(results: dict, path: Path, make=None) -> None:
    """``make(results)`` (default :func:`figure`) saved to ``path`` whole or not at all."""
    import matplotlib.pyplot as plt

    fig = (make or figure)(results)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


# -- main ----------------------------------------------------------------------------------


def evaluate_policy(name: str, directory: str, records: Sequence[dict], scorer: Scorer, human: dict, start_model,
                    samples: int, temperature: float, max_new_tokens: int, seed: int, stories_path: Path) -> dict:
    """One policy's figures on ``records`` (its stories written to ``stories_path``)."""
    began = time.time()
    model, tokenizer = load_policy(directory)
    prompts = chat_prompts(tokenizer, records)
    rows, pairs = [], []
    for j in range(samples):
        got = generate(model, tokenizer, prompts, temperature, max_new_tokens, seed + j)
        pairs += got
        rows += [f"{r['story_id']}#{j}" for r in records]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for _, c in pairs]
    kls = sequence_kl(model, start_model, pairs, temperature, tokenizer.pad_token_id)
    scores = scorer(texts)
    _write_text(stories_path, "".join(
        json.dumps({"id": row, "story": text, "kl": kl,
                    **{m: (v if math.isfinite(v) else None) for m, v in zip(DIMENSIONS, vals)}},
                   ensure_ascii=False) + "\n"
        for row, text, kl, *vals in zip(rows, texts, kls, *(scores[m] for m in DIMENSIONS))))
    entry = dhm_figures(human, {m: dict(zip(rows, scores[m])) for m in DIMENSIONS})
    entry.update({m: _mean(scores[m]) for m in DIMENSIONS})
    entry["per_sequence_scores"] = {m: per_sequence_means(rows, scores[m]) for m in DIMENSIONS}
    entry.update(story_figures(texts))
    entry["per_sequence_sentences"] = per_sequence_means(rows, [story_figures([t])["sentences"] for t in texts])
    entry["noun_recall"] = noun_recall(texts, [r["noun_phrases"] for _ in range(samples) for r in records])
    entry["kl"] = sum(kls) / len(kls)
    entry["directory"] = str(directory)
    entry["eval_seconds"] = time.time() - began
    return entry


def fingerprint(directory) -> list:
    """(name, size, modification time) of every file of a model directory: a retrained policy
    in the same directory is not mistaken for the one evaluated before."""
    root = Path(directory)
    return sorted([str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns]
                  for f in root.rglob("*") if f.is_file())


def _write_text(path: Path, text: str) -> None:
    """Whole or not at all: a killed evaluation leaves no half-written file to be reused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def evaluate(heldout, policies: dict[str, str], coherence_model: str, out_dir, samples: int = 2,
             temperature: float = 0.7, max_new_tokens: int = 96, seed: int = 0, runs_dir=None, times=None,
             limit: int | None = None, label: str = "held-out", report: bool = True) -> dict:
    """Everything of the module docs; returns the results dict (also written to OUT_DIR).

    Each policy's figures are kept in ``OUT_DIR/policies/NAME.json`` and reused
    while the evaluation settings, the policy's directory and its files (sizes,
    modification times; the start policy's too) are the same, so
    policies can be evaluated by separate processes (``report=False``: only
    those files) and then reported together; delete the file to evaluate a
    policy again."""
    from storyrl.eval.compare import paired_difference

    out_dir = Path(out_dir)
    records = load_records(heldout)[:limit]
    scorer = Scorer(coherence_model)
    human_texts = [r["story"] for r in records]
    human_scores = scorer(human_texts)
    human = {m: dict(zip((r["story_id"] for r in records), human_scores[m])) for m in DIMENSIONS}
    human_summary = {m: _mean(human_scores[m]) for m in DIMENSIONS}
    human_summary["per_sequence_scores"] = {m: per_sequence_means(list(human[m]), list(human[m].values()))
                                            for m in DIMENSIONS}
    human_summary.update(story_figures(human_texts))
    # How well the coherence model tells order: the same stories with their sentences shuffled (seeded).
    human_summary["coherence_shuffled"] = _mean(scorer.rewards["coherence"].score(shuffled(human_texts, seed)))
    start_name = next(iter(policies))
    start_model = None
    results = {"heldout": str(heldout), "label": label, "n_sequences": len(records), "samples": samples, "temperature": temperature,
               "max_new_tokens": max_new_tokens, "seed": seed, "start": start_name, "human": human_summary,
               "policies": {}, "times": read_times(times)}
    settings = {"heldout": str(heldout), "sequences": [r["story_id"] for r in records], "samples": samples,
                "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed,
                "coherence_model": str(coherence_model), "start": str(policies[start_name])}
    for name, directory in policies.items():
        if not report and name == start_name and len(policies) > 1:
            continue  # only the KL reference here: the start policy is evaluated on its own (run.sh does first)
        cache = out_dir / "policies" / f"{name}.json"
        cached = json.loads(cache.read_text(encoding="utf-8")) if cache.is_file() else None
        mine = {**settings, "directory": str(directory), "weights": fingerprint(directory),
                "start_weights": fingerprint(policies[start_name])}
        if cached is not None and cached.get("settings") == mine:
            entry = cached["entry"]
            print(f"{name}: evaluated before ({cache})", flush=True)
        else:
            if start_model is None:
                start_model, _ = load_policy(policies[start_name])
            entry = evaluate_policy(name, directory, records, scorer, human, start_model, samples, temperature,
                                    max_new_tokens, seed, out_dir / "stories" / f"{name}.jsonl")
            _write_text(cache, json.dumps({"settings": mine, "entry": entry}) + "\n")
            print(f"{name}: d_HM {entry['dhm']:.4f} (coherence {entry['dhm_coherence']:.4f}, repetition "
                  f"{entry['dhm_repetition']:.4f}), KL {entry['kl']:.2f}, distinct-2 {entry['distinct_2']:.3f}, "
                  f"sentences {entry['sentences']:.2f} ({entry['eval_seconds']:.0f} s)", flush=True)
        if runs_dir is not None:
            entry["training"] = training_figures(Path(runs_dir) / name / "history.jsonl")
        entry["seconds"] = results["times"].get(name)
        results["policies"][name] = entry
    if not report:
        return results
    start = results["policies"][start_name]["per_sequence"]
    for entry in results["policies"].values():
        # The same resamples of the sequences for every policy (one seed), so intervals compare alike.
        entry["delta"] = paired_difference(entry["per_sequence"], start, seed=seed)
    _write_text(out_dir / "results.json", json.dumps(results, indent=1) + "\n")
    _write_text(out_dir / "results.md", markdown(results))
    plot(results, out_dir / "results.png")
    return results


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout", type=Path, required=True)
    parser.add_argument("--coherence-model", required=True)
    parser.add_argument("--policy", action="append", required=True, metavar="NAME=DIR",
                        help="a policy to evaluate; the first is the start policy")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs-dir", type=Path)
    parser.add_argument("--times", type=Path)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--label", default="held-out", help="what the sequences are, for the table and plot")
    parser.add_argument("--no-report", action="store_true",
                        help="only evaluate the policies into OUT/policies/NAME.json (reused by a later run)")
    args = parser.parse_args()
    policies = dict(p.split("=", 1) for p in args.policy)
    results = evaluate(args.heldout, policies, args.coherence_model, args.out, args.samples, args.temperature,
                       args.max_new_tokens, args.seed, args.runs_dir, args.times, args.limit, args.label,
                       report=not args.no_report)
    if args.no_report:
        print(f"evaluated: {', '.join(results['policies'])} into {args.out / 'policies'}")
        return
    print((args.out / "results.md").read_text(encoding="utf-8"))
    print(f"written: {args.out / 'results.md'}, results.json, results.png ({len(results['policies'])} policies)")


if __name__ == "__main__":
    main()
