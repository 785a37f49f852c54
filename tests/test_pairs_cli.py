"""``storyrl pairs``: preference pairs from a reward over story sets (a hand
ranking), from VHED and VIST-Edit (what the loaders give), from stories
sampled from a tiny random LLaMA (tests/tiny_models.py; seeded sampling of
RL's prompt, a hand ranking, resume, locks), output safety and one-line
errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from storyrl.cli import main
from storyrl.data import StoryRecord
from storyrl.eval.pairs import DEFAULT_PROMPT, metric_pairs
from storyrl.judgements.pairs import vhed_pairs
from storyrl.judgements.vhed import VHED_COLUMNS, load_vhed
from storyrl.judgements.vist_edit import load_vist_edit, vist_edit_pairs
from storyrl.rewards import Reward, create_reward, register_reward

FRESH = "We drove to the coast early. Mia ran into the cold waves. Dad built a tall castle. A wave took half of it."
DULL = "There is a beach. There is a beach. There is a beach. There is a beach."
MID = "We went to the beach. The beach was sunny. We swam at the beach and ate lunch on the sand."


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def story_sets(tmp_path):
    # r1: three distinct stories; r2: the same story in a and b (a tie), c
    # duller; r3 only in a (no pair).
    a = write_jsonl(tmp_path / "a.jsonl", [{"story_id": "r1", "story": MID, "images": ["img/1.jpg"]},
                                           {"story_id": "r2", "story": FRESH}, {"story_id": "r3", "story": FRESH}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"story_id": "r1", "story": FRESH, "images": ["img/1.jpg"]},
                                           {"story_id": "r2", "story": FRESH}])
    c = write_jsonl(tmp_path / "c.jsonl", [{"story_id": "r1", "story": DULL}, {"story_id": "r2", "story": DULL}])
    return a, b, c


def test_metric_pairs_equal_a_hand_ranking(tmp_path, story_sets):
    a, b, c = story_sets
    rep = create_reward("repetition")
    fresh, mid, dull = (float(s) for s in rep.score([FRESH, MID, DULL]))
    assert fresh > mid > dull  # the hand ranking the expectations below rest on
    out = tmp_path / "pairs.jsonl"
    result = run("pairs", a, b, c, "-m", "repetition", "-o", out)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["pairs"] == 3 and summary["reward"] == "repetition"
    assert summary["dropped"] == {"unscorable_stories": 0, "records_with_fewer_than_2_scored_stories": 1,
                                  "tied_pairs": 1, "pairs_at_or_below_min_margin": 0}
    rows = lines(out)
    got = [(r["story_id"], r["chosen"], r["rejected"], r["source"]) for r in rows]
    assert got == [("r1", FRESH, MID, f"repetition: {b} > {a}"), ("r1", FRESH, DULL, f"repetition: {b} > {c}"),
                   ("r2", FRESH, DULL, f"repetition: {a} > {c}")]
    assert [r["margin"] for r in rows] == pytest.approx([fresh - mid, fresh - dull, fresh - dull])
    assert [r["chosen_score"] for r in rows] == pytest.approx([fresh] * 3)
    assert [r["rejected_score"] for r in rows] == pytest.approx([mid, dull, dull])
    assert [r["images"] for r in rows] == [["img/1.jpg"], ["img/1.jpg"], []]
    assert {r["prompt"] for r in rows} == {DEFAULT_PROMPT}

    # --min-margin between the two r1 margins drops the smaller one; --prompt is written
    out2 = tmp_path / "pairs2.jsonl"
    cut = (fresh - mid + fresh - dull) / 2
    result = run("pairs", a, b, c, "-m", "repetition", "-o", out2, "--min-margin", cut, "--prompt", "Tell it.")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip())["dropped"]["pairs_at_or_below_min_margin"] == 1
    assert [(r["chosen"], r["rejected"], r["prompt"]) for r in lines(out2)] == [
        (FRESH, DULL, "Tell it."), (FRESH, DULL, "Tell it.")]


class FixedReward:
    """Scores from a table, NaN for unknown stories."""

    name = "fixed"

    def __init__(self, table):
        self.table = table

    def score(self, stories, **context):
        return np.array([self.table.get(s, math.nan) for s in stories], dtype=float)


def test_metric_pairs_nan_ties_and_equal_best():
    def recs(**stories):
        return [StoryRecord(story_id=k, story=v) for k, v in stories.items()]

    reward = FixedReward({"x1": 2.0, "x2": 2.0, "x3": 1.0, "y1": 1.0, "z1": 0.5, "z3": 0.25})
    sets = [("s1", recs(x="x1", y="y1", z="z1")), ("s2", recs(x="x2", y="yNaN")), ("s3", recs(x="x3", z="z3"))]
    rows, dropped = metric_pairs(sets, reward, min_margin=0.25)
    # x: x1 and x2 tie for best -> x1 (earlier set) is best, x1~x2 a tie, x1>x3 kept;
    # y: y2 unscorable -> one scored story, no pair; z: margin 0.25 is not above 0.25.
    assert [(r["story_id"], r["chosen"], r["rejected"], r["margin"]) for r in rows] == [("x", "x1", "x3", 1.0)]
    assert dict(dropped) == {"unscorable_stories": 1, "records_with_fewer_than_2_scored_stories": 1,
                             "tied_pairs": 1, "pairs_at_or_below_min_margin": 1}
    rows, dropped = metric_pairs(sets, reward)  # min_margin 0 keeps z
    assert [(r["story_id"], r["rejected"]) for r in rows] == [("x", "x3"), ("z", "z3")]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="min_margin"):
            metric_pairs(sets, reward, min_margin=bad)
    with pytest.raises(ValueError, match="at least 2"):
        metric_pairs(sets[:1], reward)


def write_vhed(path: Path) -> Path:
    # columns in VHED_COLUMNS' order: sent1 sent2 label story_id model_base model_comp agreement img_seq
    # avg_rank_base avg_rank_comp order rank_norm
    cells = [
        ("A good story.", "A bad story.", -0.6, "s1", "reference", "kg", 5, "1 2 3", 1.2, 1.8, 5, -0.2),  # story1 better
        ("Plain words.", "Lively words.", 0.4, "s2", "kg", "pr", 2, "4 5", 2.0, 1.6, 5, 0.1),  # story2 better
        ("Same.", "Same too.", 0, "s3", "kg", "pr", 3, "6", 1.5, 1.5, 5, 0),  # zero gap: dropped by the loader
    ]
    rows = [dict(zip(VHED_COLUMNS, row)) for row in cells]
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(VHED_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_vhed_pairs_are_the_loaders(tmp_path):
    vhed = write_vhed(tmp_path / "VHED.csv")
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--vhed", vhed, "-o", out)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip())
    assert summary["pairs"] == 2 and summary["dropped"] == {"zero_gap_pairs": 1}
    expected = vhed_pairs(load_vhed(vhed))
    rows = lines(out)
    assert [(r["chosen"], r["rejected"], r["story_id"], r["margin"], r["source"]) for r in rows] == [
        (p.better, p.worse, p.story_id, p.gap, p.source) for p in expected]
    assert [(r["chosen"], r["rejected"], r["margin"]) for r in rows] == [
        ("A good story.", "A bad story.", 0.6), ("Lively words.", "Plain words.", 0.4)]
    assert all(r["chosen_score"] is None and r["rejected_score"] is None and r["images"] == [] for r in rows)


def test_vist_edit_pairs_are_the_loaders(tmp_path):
    root = tmp_path / "vist_edit"
    (root / "AREL" / "dev").mkdir(parents=True)
    (root / "AREL" / "dev" / "1.json").write_text(json.dumps({
        "photo_sequence_id": "seq1", "photo_sequence_ids": ["p1", "p2"], "auto_story_text_normalized": "we went .",
        "model": "AREL", "edited_stories": [
            {"normalized_edited_story_text_sent": ["we went to the lake .", "it was cold ."]},
            {"normalized_edited_story_text_sent": ["we went ."]}]}))
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--vist-edit", root, "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip())["pairs"] == 2
    expected = vist_edit_pairs(load_vist_edit(root))
    rows = lines(out)
    assert [(r["chosen"], r["rejected"], r["story_id"], r["source"]) for r in rows] == [
        (p.better, p.worse, p.story_id, p.source) for p in expected]
    assert [r["chosen"] for r in rows] == ["we went to the lake . it was cold .", "we went ."]
    assert all(r["rejected"] == "we went ." and r["margin"] is None for r in rows)


def test_existing_output_needs_overwrite(tmp_path):
    vhed = write_vhed(tmp_path / "VHED.csv")
    out = tmp_path / "p.jsonl"
    out.write_text("keep me\n")
    result = run("pairs", "--vhed", vhed, "-o", out)
    assert result.exit_code != 0 and "exists" in result.output and "--overwrite" in result.output
    assert out.read_text() == "keep me\n"
    result = run("pairs", "--vhed", vhed, "-o", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert len(lines(out)) == 2


@pytest.mark.parametrize("extra, message", [
    ([], "exactly one source"),
    (["--vhed", "{vhed}", "{a}", "{b}", "-m", "repetition"], "exactly one source"),
    (["--vhed", "{vhed}", "-m", "repetition"], "come from people"),
    (["{a}", "-m", "repetition"], "two or more STORIES"),
    (["{a}", "{b}"], "exactly one reward"),
    (["{a}", "{b}", "-m", "repetition,length"], "exactly one reward"),
    (["{a}", "{a}", "-m", "repetition"], "given twice"),
    (["{a}", "{b}", "-m", "no_such_reward"], "no_such_reward"),
    (["{a}", "{b}", "-m", "repetition", "--min-margin", "-1"], "--min-margin"),
])
def test_bad_options_are_one_line_errors(tmp_path, story_sets, extra, message):
    a, b, _ = story_sets
    vhed = write_vhed(tmp_path / "VHED.csv")
    args = [x.format(a=a, b=b, vhed=vhed) for x in extra]
    out = tmp_path / "p.jsonl"
    result = run("pairs", *args, "-o", out)
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and message in error[0], result.output
    assert not out.exists()


def test_out_must_be_jsonl(tmp_path, story_sets):
    a, b, _ = story_sets
    result = run("pairs", a, b, "-m", "repetition", "-o", tmp_path / "p.csv")
    assert result.exit_code == 2 and "*.jsonl" in result.output


# -- pairs sampled from a policy (--policy) ---------------------------------------------------

# P3 of configs/prompts/dhm.yaml, filled in by hand (the words the tiny tokenizer knows).
P3 = ("Output a story about this sequence of images using only {n} sentences. "
      "Make sure the story does not include more than {n} sentences.")
HUMAN = ["a dog ran to the park .", "the cat sat on a red mat .", "we went home and slept ."]


@register_reward()
class _Overlap(Reward):
    """Test reward: words shared with the human story (``reference``
    context) plus a hundredth of the distinct words; needs the reference."""

    name = "test_pairs_overlap"

    def _score_batch(self, stories, reference=None, **context):
        assert reference is not None and all(isinstance(r, str) for r in reference)
        return np.array([len(set(s.split()) & set(r.split())) + len(set(s.split())) / 100
                         for s, r in zip(stories, reference)])


@pytest.fixture(scope="module")
def policy_assets(tmp_path_factory):
    from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

    root = tmp_path_factory.mktemp("policy")
    images = [str(p) for p in write_images(root / "images", 4)]
    data = root / "data.jsonl"
    # s0/s2: the story is the human one; s1 has its own reference; sequences of 3, 4, 3 images.
    records = [{"story_id": "s0", "story": HUMAN[0], "images": images[:3]},
               {"story_id": "s1", "story": "x", "reference": HUMAN[1], "images": images[:4]},
               {"story_id": "s2", "story": HUMAN[2], "images": images[1:4]}]
    write_jsonl(data, records)
    texts = [*TAPM_TEXTS, *HUMAN, P3.format(n="three"), P3.format(n="four")]
    return {"root": root, "images": images, "data": str(data), "records": records,
            "chat": save_tiny_llama(root / "llama", texts), "plain": save_tiny_llama(root / "plain", texts, chat=False)}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    import torch

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads cost more than they save
    yield
    torch.set_num_threads(threads)


def policy_args(assets, out, model="chat", *extra):
    return ["pairs", "--policy", assets[model], "--data", assets["data"], "-m", "test_pairs_overlap",
            "--max-new-tokens", 6, "-o", out, *extra]


def sidecar(out: Path) -> list[dict]:
    return lines(out.with_name(out.stem + ".samples.jsonl"))


@pytest.fixture
def generate_calls(monkeypatch):
    """Counts model.generate calls (one per sampled sequence)."""
    from transformers.generation.utils import GenerationMixin

    calls = []
    original = GenerationMixin.generate

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("num_return_sequences", 1))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counted)
    return calls


def rl_prompts(assets, model="chat"):
    from transformers import AutoTokenizer

    from storyrl.datasets import load_records
    from storyrl.training.storyteller.rl.data import prompt_rows
    from storyrl.training.storyteller.config import StorytellerConfig

    config = StorytellerConfig.from_mapping({"model": assets[model], "data": assets["data"], "prompt": "P3"})
    return prompt_rows(config, load_records(assets["data"]), "causal_lm", AutoTokenizer.from_pretrained(assets[model]))


def test_policy_samples_are_seeded_sampling_of_rls_prompt(policy_assets, tmp_path, generate_calls):
    """The sidecar's stories are what transformers samples, from the seed of
    (seed, story id), for the chat-templated RL prompt; the rows carry that prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.eval.pairs import _row_seed

    out = tmp_path / "pairs.jsonl"
    result = run(*policy_args(policy_assets, out, "chat", "-k", 3, "--seed", 7, "--temperature", 1.5))
    assert result.exit_code == 0, result.output
    assert generate_calls == [3, 3, 3]  # one call per sequence, k stories each
    header, *samples = sidecar(out)
    assert header["options"]["k"] == 3 and header["options"]["seed"] == 7
    rows = rl_prompts(policy_assets)
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": P3.format(n=n)}]
                                           for n in ("three", "four", "three")]
    tokenizer = AutoTokenizer.from_pretrained(policy_assets["chat"])
    model = AutoModelForCausalLM.from_pretrained(policy_assets["chat"]).eval()
    for row, got in zip(rows, samples):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        torch.manual_seed(_row_seed(7, row["story_id"]))
        with torch.inference_mode():
            new = model.generate(**ids, max_new_tokens=6, do_sample=True, temperature=1.5, top_p=1.0, top_k=0,
                                 num_return_sequences=3, pad_token_id=tokenizer.pad_token_id)
        want = [t.strip() for t in tokenizer.batch_decode(new[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)]
        assert got == {"story_id": row["story_id"], "samples": want}
    assert len({s for entry in samples for s in entry["samples"]}) > 3  # sampling, not greedy
    for row in lines(out):
        assert row["prompt"] == next(r["prompt"] for r in rows if r["story_id"] == row["story_id"])


def hand_pairs(assets, samples, min_margin=0.0):
    """Best (first of the highest) vs each other sample, scored by hand."""
    reward = create_reward("test_pairs_overlap")
    want, dropped = [], {"unscorable_stories": 0, "records_with_fewer_than_2_scored_stories": 0,
                         "tied_pairs": 0, "pairs_at_or_below_min_margin": 0}
    for record, entry in zip(assets["records"], samples):
        texts = entry["samples"]
        human = record.get("reference", record["story"])
        scores = [float(s) for s in reward.score(texts, reference=[human] * len(texts))]
        best = max(range(len(texts)), key=lambda j: (scores[j], -j))
        for j in range(len(texts)):
            if j == best:
                continue
            margin = scores[best] - scores[j]
            if margin == 0:
                dropped["tied_pairs"] += 1
            elif margin <= min_margin:
                dropped["pairs_at_or_below_min_margin"] += 1
            else:
                want.append((record["story_id"], texts[best], texts[j], scores[best], scores[j], record["images"],
                             f"sample {best + 1} > sample {j + 1}"))
    return want, dropped


@pytest.mark.parametrize("model", ["chat", "plain"])
def test_policy_pairs_equal_a_hand_ranking(policy_assets, tmp_path, model):
    out = tmp_path / "pairs.jsonl"
    result = run(*policy_args(policy_assets, out, model, "-k", 4))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    samples = sidecar(out)[1:]
    assert [len(s["samples"]) for s in samples] == [4, 4, 4]
    want, dropped = hand_pairs(policy_assets, samples)
    assert len(want) >= 3  # the test below needs pairs to drop
    rows = lines(out)
    got = [(r["story_id"], r["chosen"], r["rejected"], r["images"], r["source"].split(": ", 1)[1]) for r in rows]
    assert got == [(w[0], w[1], w[2], w[5], w[6]) for w in want]
    assert [r["chosen_score"] for r in rows] == pytest.approx([w[3] for w in want])
    assert [r["rejected_score"] for r in rows] == pytest.approx([w[4] for w in want])
    assert [r["margin"] for r in rows] == pytest.approx([w[3] - w[4] for w in want])
    assert all(r["source"].startswith(f"policy {policy_assets[model]}, test_pairs_overlap: ") for r in rows)
    prompts = {r["story_id"]: r["prompt"] for r in rl_prompts(policy_assets, model)}
    assert all(r["prompt"] == prompts[r["story_id"]] for r in rows)
    if model == "plain":  # no chat template: the prompt is the text
        assert all(isinstance(r["prompt"], str) for r in rows)
    assert summary["pairs"] == len(want) and summary["dropped"] == dropped
    assert summary["sequences"] == {"sampled": 3, "reused": 0} and summary["reward"] == "test_pairs_overlap"

    # --min-margin between the kept margins drops the smaller ones (the same samples: seed 0)
    margins = sorted(w[3] - w[4] for w in want)
    cut = (margins[0] + margins[-1]) / 2
    out2 = tmp_path / "pairs2.jsonl"
    result = run(*policy_args(policy_assets, out2, model, "-k", 4, "--min-margin", cut))
    assert result.exit_code == 0, result.output
    assert sidecar(out2)[1:] == samples
    want2, dropped2 = hand_pairs(policy_assets, samples, cut)
    assert 0 < len(want2) < len(want) and dropped2["pairs_at_or_below_min_margin"] > 0
    assert [(r["chosen"], r["rejected"]) for r in lines(out2)] == [(w[1], w[2]) for w in want2]
    assert json.loads(result.stdout.strip().splitlines()[-1])["dropped"] == dropped2


def test_policy_pairs_ties_nan_and_equal_best():
    from storyrl.eval.pairs import policy_pairs

    rows = [{"story_id": "a", "prompt": [{"role": "user", "content": "Tell."}], "reference": "h",
             "story_images": ["1.jpg", "2.jpg"]},
            {"story_id": "b", "prompt": "Tell b.", "reference": "h"}]
    samples = {"a": ["a1", "a2", "a3", "a4"], "b": ["b1", "b2", "b3", "b4"]}
    reward = FixedReward({"a1": 1.0, "a2": 3.0, "a3": 3.0, "a4": 2.5, "b1": 0.0, "b3": 0.0, "b4": 0.0})
    got, dropped = policy_pairs(rows, samples, reward, source="policy P", min_margin=0.5)
    # a: a2 and a3 tie for best -> a2 (earlier sample); a2~a3 tie; a4 within the margin; a1 kept.
    # b: b2 unscorable; b1, b3, b4 all tie.
    assert [(r["story_id"], r["chosen"], r["rejected"], r["margin"], r["prompt"], r["images"], r["source"])
            for r in got] == [("a", "a2", "a1", 2.0, [{"role": "user", "content": "Tell."}],
                               [str(Path.cwd() / "1.jpg"), str(Path.cwd() / "2.jpg")],  # absolute, as found
                               "policy P, fixed: sample 2 > sample 1")]
    assert dict(dropped) == {"unscorable_stories": 1, "records_with_fewer_than_2_scored_stories": 0,
                             "tied_pairs": 3, "pairs_at_or_below_min_margin": 1}


def test_seed_temperature_top_p_and_k_change_the_samples(policy_assets, tmp_path):
    from storyrl.datasets import load_records
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import generate_stories

    def samples(name, *extra):
        out = tmp_path / f"{name}.jsonl"
        result = run(*policy_args(policy_assets, out, "chat", *extra))
        return result, sidecar(out)[1:]

    _, base = samples("base", "-k", 3)
    assert samples("again", "-k", 3)[1] == base  # the same command, the same stories
    assert samples("seed", "-k", 3, "--seed", 1)[1] != base
    _, two = samples("k2", "-k", 2)
    assert [len(s["samples"]) for s in two] == [2, 2, 2]
    # Near-zero temperature or top_p: every sample is the greedy story, all tie: no pair.
    config = RLConfig.from_mapping({"model": policy_assets["chat"], "data": policy_assets["data"], "prompt": "P3",
                                    "rewards": [{"reward": "repetition"}], "grpo": {"max_completion_length": 6},
                                    "output_dir": str(tmp_path / "rl")})
    greedy = generate_stories(config, policy_assets["chat"], load_records(policy_assets["data"]))
    for extra in (["--temperature", 1e-4], ["--top-p", 1e-6]):
        result, got = samples("greedy", "-k", 3, *extra)
        assert [s["samples"] for s in got] == [[greedy[s["story_id"]]] * 3 for s in got]
        assert result.exit_code == 1 and "no pair kept" in result.output and '"tied_pairs": 6' in result.output
        assert not (tmp_path / "greedy.jsonl").exists()
        (tmp_path / "greedy.samples.jsonl").unlink()


def test_resume_after_an_interruption_equals_an_uninterrupted_run(policy_assets, tmp_path, generate_calls):
    full = tmp_path / "full.jsonl"
    assert run(*policy_args(policy_assets, full, "chat", "-k", 3)).exit_code == 0
    full_side = full.with_name("full.samples.jsonl").read_text()
    header, first, second, _ = full_side.splitlines(keepends=True)
    # Interrupted after s0, while writing s1 (a cut line).
    out = tmp_path / "part.jsonl"
    side = tmp_path / "part.samples.jsonl"
    side.write_text(header + first + second[:10])
    generate_calls.clear()
    result = run(*policy_args(policy_assets, out, "chat", "-k", 3, "--resume"))
    assert result.exit_code == 0, result.output
    assert len(generate_calls) == 2  # s0 reused, s1 and s2 sampled
    assert json.loads(result.stdout.strip().splitlines()[-1])["sequences"] == {"sampled": 2, "reused": 1}
    assert out.read_text() == full.read_text() and side.read_text() == full_side

    # Everything sampled: --resume samples nothing and re-ranks (here with a margin).
    generate_calls.clear()
    result = run(*policy_args(policy_assets, out, "chat", "-k", 3, "--resume", "--min-margin", 1e-9))
    assert result.exit_code == 0, result.output and generate_calls == []
    assert json.loads(result.stdout.strip().splitlines()[-1])["sequences"] == {"sampled": 0, "reused": 3}

    # Other sampling options: a one-line refusal, nothing touched.
    before = side.read_text(), out.read_text()
    for extra, named in ((["--seed", 1], "seed"), (["-k", 2], "k"), (["--temperature", 0.5], "temperature")):
        result = run(*policy_args(policy_assets, out, "chat", "-k", 3, *extra, "--resume"))
        assert result.exit_code == 2, result.output
        error = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert len(error) == 1 and "other options" in error[0] and named in error[0], result.output
    assert (side.read_text(), out.read_text()) == before and generate_calls == []


def test_existing_and_locked_outputs(policy_assets, tmp_path, generate_calls):
    from storyrl.output_files import LockedOutput

    out = tmp_path / "p.jsonl"
    out.write_text("keep me\n")
    result = run(*policy_args(policy_assets, out, "chat", "-k", 2))
    assert result.exit_code != 0 and "exists" in result.output and "--overwrite" in result.output
    assert out.read_text() == "keep me\n" and generate_calls == []
    out.unlink()
    side = tmp_path / "p.samples.jsonl"
    side.write_text("old samples\n")
    result = run(*policy_args(policy_assets, out, "chat", "-k", 2))
    assert result.exit_code != 0 and "p.samples.jsonl exists" in result.output and not out.exists()
    result = run(*policy_args(policy_assets, out, "chat", "-k", 2, "--resume"))  # not a samples file
    assert result.exit_code == 2 and "not a storyrl pairs samples file" in result.output
    result = run(*policy_args(policy_assets, out, "chat", "-k", 2, "--overwrite"))
    assert result.exit_code == 0, result.output
    assert len(sidecar(out)) == 4 and generate_calls == [2, 2, 2]
    # A second writer fails at once, before sampling.
    generate_calls.clear()
    for held in (out, side):
        with LockedOutput(held, existing="keep"):
            result = run(*policy_args(policy_assets, out, "chat", "-k", 2, "--overwrite"))
        assert result.exit_code != 0 and "in use by another process" in result.output, result.output
    assert generate_calls == []


@pytest.mark.parametrize("extra, message", [
    (["--policy", "{chat}", "-m", "test_pairs_overlap"], "needs --data"),
    (["--policy", "{chat}", "{a}", "{b}", "--data", "{data}", "-m", "test_pairs_overlap"], "exactly one source"),
    (["--policy", "{chat}", "--data", "{data}"], "exactly one reward"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap,length"], "exactly one reward"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "-k", "1"], "-k"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--temperature", "0"], "--temperature"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--top-p", "1.5"], "--top-p"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--prompt", "Tell."], "--prompt-name"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--resume", "--overwrite"], "give one"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--prompt-name", "P9"], "P9"),
    (["--policy", "{chat}", "--data", "{data}", "-m", "test_pairs_overlap", "--setting", "visual"], "setting visual"),
    (["{a}", "{b}", "-m", "repetition", "--seed", "1"], "--seed is a --policy option"),
    (["{a}", "{b}", "-m", "repetition", "--resume"], "--resume is a --policy option"),
])
def test_bad_policy_options_are_one_line_errors(policy_assets, tmp_path, story_sets, extra, message):
    a, b, _ = story_sets
    args = [x.format(a=a, b=b, chat=policy_assets["chat"], data=policy_assets["data"]) for x in extra]
    out = tmp_path / "p.jsonl"
    result = run("pairs", *args, "-o", out)
    assert result.exit_code in (1, 2), result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and message in error[0], result.output
    assert not out.exists() and not (tmp_path / "p.samples.jsonl").exists()


def test_missing_policy_and_duplicate_sequences_are_one_line_errors(policy_assets, tmp_path):
    out = tmp_path / "p.jsonl"
    result = run(*policy_args({**policy_assets, "chat": str(tmp_path / "nowhere")}, out))
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "nowhere" in result.output
    twice = write_jsonl(tmp_path / "twice.jsonl", [policy_assets["records"][0]] * 2)
    result = run(*policy_args({**policy_assets, "data": str(twice)}, out))
    assert result.exit_code == 1 and "duplicate story id" in result.output, result.output  # the loader's check
    assert not out.exists() and not (tmp_path / "p.samples.jsonl").exists()


def test_vhed_image_ids_resolve_with_image_root(tmp_path):
    vhed = write_vhed(tmp_path / "VHED.csv")
    root = tmp_path / "imgs"
    root.mkdir()
    for name in ("1", "2", "3", "4", "5"):
        (root / f"{name}.jpg").write_bytes(b"x")
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--vhed", vhed, "--image-root", root, "-o", out)
    assert result.exit_code == 0, result.output
    assert [r["images"] for r in lines(out)] == [[str(root / f"{n}.jpg") for n in "123"],
                                                 [str(root / f"{n}.jpg") for n in "45"]]
    (root / "5.jpg").unlink()
    result = run("pairs", "--vhed", vhed, "--image-root", root, "-o", out, "--overwrite")
    assert result.exit_code == 1 and "5" in result.output and len(result.output.strip().splitlines()) == 1


def test_vlm_policy_rows_carry_the_conversation_and_the_image_paths(policy_assets, tmp_path, generate_calls,
                                                                    monkeypatch):
    """A VLM is sampled with the sequence image (RL's visual setting): the
    rows' prompt is RL's conversation, ``images`` the sequence's paths."""
    from tiny_models import TAPM_TEXTS, save_tiny_chat_vlm
    from transformers.generation.utils import GenerationMixin

    vlm = save_tiny_chat_vlm(tmp_path / "vlm", [*TAPM_TEXTS, *HUMAN, P3.format(n="three"), P3.format(n="four")])
    seen = []
    counted = GenerationMixin.generate

    def with_pixels(self, *args, **kwargs):
        seen.append(tuple(kwargs["pixel_values"].shape[:1]) if "pixel_values" in kwargs else None)
        return counted(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", with_pixels)
    out = tmp_path / "p.jsonl"
    result = run("pairs", "--policy", vlm, "--data", policy_assets["data"], "-m", "test_pairs_overlap",
                 "--max-new-tokens", 4, "-k", 3, "-o", out)
    assert result.exit_code == 0, result.output
    assert seen == [(1,), (1,), (1,)] and generate_calls == [3, 3, 3]  # one sequence image per prompt
    samples = sidecar(out)[1:]
    assert [len(s["samples"]) for s in samples] == [3, 3, 3]
    rows = lines(out)
    assert rows
    for row in rows:
        record = next(r for r in policy_assets["records"] if r["story_id"] == row["story_id"])
        n = {3: "three", 4: "four"}[len(record["images"])]
        assert row["prompt"] == [{"role": "user", "content": [{"type": "image"},
                                                              {"type": "text", "text": P3.format(n=n)}]}]
        assert row["images"] == record["images"]


# -- the review's breaks (defaults, resume digest, LoRA, TAPM, device, overwrite) and the reference / round trip --


def summary_of(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def one_error(result) -> str:
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1, result.output
    return error[0]


def test_k_defaults_to_4(policy_assets, tmp_path, generate_calls):
    out = tmp_path / "p.jsonl"
    result = run(*policy_args(policy_assets, out))
    assert result.exit_code == 0, result.output
    assert generate_calls == [4, 4, 4]
    header, *samples = sidecar(out)
    assert header["options"]["k"] == 4 and [len(s["samples"]) for s in samples] == [4, 4, 4]


def test_duplicate_story_ids_from_the_data_are_one_line_errors(policy_assets, tmp_path, monkeypatch):
    """The CLI's own check (the loaders' check may not cover every format)."""
    from storyrl.training.storyteller.rl import data as rl_data

    load = rl_data.load_data

    def twice(config):
        records = load(config)
        return [*records, records[0]]

    monkeypatch.setattr(rl_data, "load_data", twice)
    out = tmp_path / "p.jsonl"
    result = run(*policy_args(policy_assets, out))
    assert result.exit_code == 1 and "'s0' appears twice" in one_error(result), result.output
    assert not out.exists() and not (tmp_path / "p.samples.jsonl").exists()


@pytest.fixture(scope="module")
def adapter_dir(policy_assets, tmp_path_factory):
    """LoRA adapters (peft) on the tiny chat LLaMA, with its tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("adapter")
    base = AutoModelForCausalLM.from_pretrained(policy_assets["chat"])
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(directory)
    AutoTokenizer.from_pretrained(policy_assets["chat"]).save_pretrained(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == policy_assets["chat"]
    return directory


def test_lora_adapters_load_on_their_base(policy_assets, adapter_dir, tmp_path, generate_calls):
    out = tmp_path / "p.jsonl"
    result = run(*policy_args({**policy_assets, "chat": str(adapter_dir)}, out, "chat", "-k", 2))
    assert result.exit_code == 0, result.output
    assert generate_calls == [2, 2, 2]
    header, *samples = sidecar(out)
    assert header["options"]["policy"] == str(adapter_dir.resolve())
    # The adapters (non-zero LoRA weights) change the base's stories: they are applied, not skipped.
    base_out = tmp_path / "base.jsonl"
    assert run(*policy_args(policy_assets, base_out, "chat", "-k", 2)).exit_code == 0
    assert [s["samples"] for s in samples] != [s["samples"] for s in sidecar(base_out)[1:]]

    nameless = tmp_path / "nameless"
    nameless.mkdir()
    for f in adapter_dir.iterdir():
        (nameless / f.name).write_bytes(f.read_bytes())
    config = json.loads((nameless / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (nameless / "adapter_config.json").write_text(json.dumps(config))
    out2 = tmp_path / "p2.jsonl"
    result = run(*policy_args({**policy_assets, "chat": str(nameless)}, out2))
    assert result.exit_code != 0
    assert "names no base model" in one_error(result) and len(result.output.strip().splitlines()) == 1
    assert not out2.exists()


def test_resume_ignores_sequences_no_longer_in_the_data(policy_assets, tmp_path, generate_calls):
    data = write_jsonl(tmp_path / "data.jsonl", policy_assets["records"])
    assets = {**policy_assets, "data": str(data)}
    out = tmp_path / "p.jsonl"
    assert run(*policy_args(assets, out, "chat", "-k", 3)).exit_code == 0
    write_jsonl(data, policy_assets["records"][:2])  # s2 removed from the data
    generate_calls.clear()
    result = run(*policy_args(assets, out, "chat", "-k", 3, "--resume"))
    assert result.exit_code == 0, result.output
    assert generate_calls == [] and summary_of(result)["sequences"] == {"sampled": 0, "reused": 2}
    assert {r["story_id"] for r in lines(out)} <= {"s0", "s1"}


def test_a_tapm_policy_is_refused(policy_assets, tmp_path):
    from storyrl.generators import TAPM_MODEL_TYPE

    tapm = tmp_path / "tapm"
    tapm.mkdir()
    (tapm / "config.json").write_text(json.dumps({"model_type": TAPM_MODEL_TYPE}))
    out = tmp_path / "p.jsonl"
    result = run(*policy_args({**policy_assets, "chat": str(tapm)}, out))
    assert result.exit_code == 1 and "TAPM policy" in one_error(result), result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "p.samples.jsonl").exists()


@pytest.mark.parametrize("named, extra", [
    ("setting", ["--setting", "text"]),
    ("prompt_name", ["--prompt-name", "P1"]),
    ("prompts_file", ["--prompts-file", "{prompts_copy}"]),
    ("image_root", ["--image-root", "{root}"]),
    ("max_new_tokens", ["--max-new-tokens", "5"]),
    ("top_p", ["--top-p", "0.9"]),
    ("k", ["-k", "3"]),
    ("seed", ["--seed", "1"]),
    ("temperature", ["--temperature", "0.5"]),
    ("policy", ["--policy", "{plain}"]),
    ("data", ["--data", "{data_copy}"]),
])
def test_resume_refuses_every_other_sampling_option(policy_assets, tmp_path, generate_calls, named, extra):
    prompts_copy = tmp_path / "prompts.yaml"
    prompts_copy.write_text((Path(__file__).resolve().parents[1] / "configs/prompts/dhm.yaml").read_text())
    data_copy = tmp_path / "data_copy.jsonl"
    data_copy.write_text(Path(policy_assets["data"]).read_text())
    out = tmp_path / "p.jsonl"
    assert run(*policy_args(policy_assets, out, "chat", "-k", 2)).exit_code == 0
    before = out.read_text(), out.with_name("p.samples.jsonl").read_text()
    generate_calls.clear()
    values = {"prompts_copy": prompts_copy, "root": tmp_path, "plain": policy_assets["plain"], "data_copy": data_copy}
    args = [*policy_args(policy_assets, out, "chat", "-k", 2), "--resume"]
    # Later options win (click keeps the last value of a repeated option).
    args += [x.format(**values) for x in extra]
    result = run(*args)
    assert result.exit_code == 2, result.output
    error = one_error(result)
    assert "other options" in error and named in error.split("other options", 1)[1], error
    assert generate_calls == [] and (out.read_text(), out.with_name("p.samples.jsonl").read_text()) == before


@pytest.mark.parametrize("option", ["--image-ids", "--noun-phrases"])
def test_context_files_with_a_policy_are_one_line_errors(policy_assets, tmp_path, option):
    table = tmp_path / "table.json"
    table.write_text("{}")
    out = tmp_path / "p.jsonl"
    result = run(*policy_args(policy_assets, out), option, table)
    assert result.exit_code == 2 and "with --policy the sequences come from --data" in one_error(result)
    assert not out.exists() and not (tmp_path / "p.samples.jsonl").exists()


def test_device_moves_the_policy(policy_assets, tmp_path, monkeypatch):
    import torch
    from transformers import PreTrainedModel

    from storyrl.models import runtime

    asked, moved = [], []
    device = torch.device("cpu")
    resolve = runtime.resolve_device

    def resolve_device(value=None, *args, **kwargs):
        asked.append(value)
        return device if value == "cpu" else resolve(value, *args, **kwargs)

    to = PreTrainedModel.to

    def spy(self, *args, **kwargs):
        moved.append(args[0] if args else kwargs.get("device"))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(runtime, "resolve_device", resolve_device)
    monkeypatch.setattr(PreTrainedModel, "to", spy)
    out = tmp_path / "p.jsonl"
    result = run(*policy_args(policy_assets, out, "chat", "-k", 2), "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "cpu" in asked and any(m is device for m in moved), (asked, moved)


def test_overwrite_and_a_finished_resume_replace_out(policy_assets, tmp_path):
    out = tmp_path / "p.jsonl"
    old = "".join(json.dumps({"old": i}) + "\n" for i in range(40))
    out.write_text(old)
    result = run(*policy_args(policy_assets, out, "chat", "-k", 3, "--overwrite"))
    assert result.exit_code == 0, result.output
    rows = lines(out)
    assert len(rows) == summary_of(result)["pairs"] and all("old" not in r for r in rows)
    out.write_text(old)  # the samples file is complete: --resume re-ranks and replaces OUT
    result = run(*policy_args(policy_assets, out, "chat", "-k", 3, "--resume"))
    assert result.exit_code == 0, result.output
    assert lines(out) == rows and len(rows) == summary_of(result)["pairs"]


def test_open_samples_refuses_a_non_empty_file_without_overwrite(tmp_path):
    from storyrl.eval.pairs import open_samples
    from storyrl.output_files import OutputExistsError

    path = tmp_path / "p.samples.jsonl"
    path.write_text("old\n")
    with pytest.raises(OutputExistsError):
        open_samples(path, {"k": 2}, resume=False, overwrite=False)
    assert path.read_text() == "old\n"
    store, done = open_samples(path, {"k": 2}, resume=False, overwrite=True)
    store.close()
    assert done == {} and json.loads(path.read_text())["options"] == {"k": 2}


def test_pair_rows_carry_the_human_story(policy_assets, tmp_path, story_sets):
    out = tmp_path / "p.jsonl"
    assert run(*policy_args(policy_assets, out, "chat", "-k", 3)).exit_code == 0
    human = {r["story_id"]: r.get("reference", r["story"]) for r in policy_assets["records"]}
    rows = lines(out)
    assert rows and all(r["reference"] == human[r["story_id"]] for r in rows)
    # story sets: the records' reference (from any set) when they have one, else no key
    a, b, c = story_sets
    a2 = write_jsonl(tmp_path / "a2.jsonl", [{**r, "reference": f"human {r['story_id']}"} for r in lines(a)])
    out2 = tmp_path / "s.jsonl"
    assert run("pairs", c, a2, b, "-m", "repetition", "-o", out2).exit_code == 0
    assert [r["reference"] for r in lines(out2)] == ["human r1", "human r1", "human r2"]
    out3 = tmp_path / "s3.jsonl"
    assert run("pairs", a, b, c, "-m", "repetition", "-o", out3).exit_code == 0
    assert all("reference" not in r for r in lines(out3))


def test_round_trips_by_hand(policy_assets):
    from transformers import AutoTokenizer

    from storyrl.eval.pairs import round_trips

    tok = AutoTokenizer.from_pretrained(policy_assets["chat"])
    ids = tok("a dog ran", add_special_tokens=False).input_ids
    assert len(ids) == 3
    assert round_trips(tok, [*ids, tok.eos_token_id, tok.pad_token_id], "a dog ran")  # specials and pads left out
    assert not round_trips(tok, ids, "a dog")
    assert not round_trips(tok, ids[::-1], "a dog ran")


@register_reward()
class _Chars(Reward):
    """Test reward: the story's length in characters (any text scores)."""

    name = "test_pairs_chars"

    def _score_batch(self, stories, **context):
        return np.array([float(len(s)) for s in stories])


def test_stories_that_do_not_re_encode_are_counted(policy_assets, tmp_path):
    """The tiny tokenizer re-encodes its decoded text (count 0); with a
    decoder that glues words together it does not (every story of 2+
    words, words then read as one unknown token)."""
    from tokenizers import decoders
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "p.jsonl"
    args = ["pairs", "--data", policy_assets["data"], "-m", "test_pairs_chars", "--max-new-tokens", 6, "-k", 3]
    result = run(*args, "--policy", policy_assets["chat"], "-o", out)
    assert result.exit_code == 0, result.output
    assert summary_of(result)["stories_not_round_tripping"] == 0 and "warning" not in result.output

    glued = tmp_path / "glued"
    tok = AutoTokenizer.from_pretrained(policy_assets["chat"])
    tok.backend_tokenizer.decoder = decoders.Fuse()
    tok.save_pretrained(glued)
    AutoModelForCausalLM.from_pretrained(policy_assets["chat"]).save_pretrained(glued)
    out2 = tmp_path / "g.jsonl"
    result = run(*args, "--policy", glued, "-o", out2)
    assert result.exit_code == 0, result.output
    # The same weights, prompt ids and seeds sample the same token ids: the spaced texts (which round-trip,
    # count 0 above) are their re-encoding; a glued text not encoding like its spaced one does not round-trip.
    spaced = [t for s in sidecar(out)[1:] for t in s["samples"]]
    texts = [t for s in sidecar(out2)[1:] for t in s["samples"]]
    assert [t.replace(" ", "") for t in spaced] == texts
    want = sum(tok(g, add_special_tokens=False).input_ids != tok(t, add_special_tokens=False).input_ids
               for g, t in zip(texts, spaced))
    assert want > 0 and summary_of(result)["stories_not_round_tripping"] == want
    warnings = [line for line in result.output.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and f"{want} of 9 sampled stories" in warnings[0], result.output


# -- issue 31: what storyrl pairs writes, the trainers read --------------------------------------------


def test_an_empty_story_a_reward_scores_is_dropped_as_unscorable():
    """rouge_l and others score an empty story (0); a policy may sample
    one. A pair with an empty side is refused by DPO and the reward model,
    so it is never written: the story counts as unscorable."""
    def recs(**stories):
        return [StoryRecord(story_id=k, story=v) for k, v in stories.items()]

    reward = FixedReward({"x1": 2.0, "": 0.0, " ": 0.0, "x3": 1.0, "y1": 1.0})
    sets = [("s1", recs(x="x1", y="y1")), ("s2", recs(x="", y=" ")), ("s3", recs(x="x3"))]
    rows, dropped = metric_pairs(sets, reward)
    assert [(r["story_id"], r["chosen"], r["rejected"]) for r in rows] == [("x", "x1", "x3")]
    assert dropped["unscorable_stories"] == 2 and dropped["records_with_fewer_than_2_scored_stories"] == 1


def test_relative_image_roots_give_absolute_image_paths(policy_assets, tmp_path, monkeypatch):
    """The pairs file is read from elsewhere (DPO resolves a relative path
    against its own image_root, its data's): paths found from a relative
    --image-root are written absolute, for --vhed and --policy alike."""
    from storyrl.judgements.pairs import read_preference_rows

    write_vhed(tmp_path / "VHED.csv")
    (tmp_path / "imgs").mkdir()
    for name in "12345":
        (tmp_path / "imgs" / f"{name}.jpg").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    result = run("pairs", "--vhed", "VHED.csv", "--image-root", "imgs", "-o", "p.jsonl")
    assert result.exit_code == 0, result.output
    assert lines(tmp_path / "p.jsonl")[0]["images"] == [str(tmp_path / "imgs" / f"{n}.jpg") for n in "123"]
    data = write_jsonl(tmp_path / "ids.jsonl", [{"story_id": "s0", "story": HUMAN[0], "image_ids": ["1", "2", "3"]},
                                                {"story_id": "s1", "story": HUMAN[1], "image_ids": ["3", "4"]}])
    result = run("pairs", "--policy", policy_assets["chat"], "--data", data.name, "--image-root", "imgs",
                 "-m", "test_pairs_overlap", "--max-new-tokens", 6, "-o", "q.jsonl")
    assert result.exit_code == 0, result.output
    rows = read_preference_rows(tmp_path / "q.jsonl")
    assert rows and all(Path(i).is_absolute() and Path(i).parent == tmp_path / "imgs" for r in rows
                        for i in r["images"])
