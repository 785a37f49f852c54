"""examples/rl_vist on a tiny slice, so the example cannot rot: the data
split, the prompt hook of ``train_rl.py`` (the prompts ``storyrl train rl``
builds must be the ones the policy was pretrained on and is evaluated with)
and the evaluation (d_HM, KL, distinct-n, table and plot) with a tiny
pretrained policy and a tiny random coherence model. No ../shared data: the
stories and concreteness ratings are made up here."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_vist"
sys.path.insert(0, str(EXAMPLE))

import common
import prepare_data

SENTENCES = ["the dog ran to the park .", "we saw a big tree .", "my mom made a cake .", "the car was red .",
             "a cat sat on the roof .", "we went to the beach .", "the kids played with a ball .",
             "there was a church on the hill ."]
RATINGS = {"dog": 4.9, "park": 4.6, "tree": 5.0, "mom": 4.4, "cake": 4.9, "car": 4.9, "cat": 4.9, "roof": 4.8,
           "beach": 4.9, "kid": 4.6, "ball": 5.0, "church": 4.9, "hill": 4.7, "big": 2.9, "red": 4.1, "saw": 4.6}


def _stories(n: int = 30) -> dict[str, str]:
    out = {}
    for k in range(n):
        sentences = [SENTENCES[(k + j) % len(SENTENCES)] for j in range(5)]
        out[str(1000 + k)] = " ".join(sentences[: 1 if k % 10 == 3 else 5])  # ids 1003, 1013, 1023: one sentence
    return out


@pytest.fixture
def tiny_data(tmp_path):
    stories = tmp_path / "gt.json"
    stories.write_text(json.dumps(_stories()))
    ratings = tmp_path / "concreteness.csv"
    ratings.write_text("\ufeffWord;Conc.M\n" + "".join(f"{w};{r}\n" for w, r in RATINGS.items()))
    summary = prepare_data.prepare(stories, tmp_path / "data", n_train=12, n_heldout=4, n_val=3,
                                   heldout_fraction=0.2, seed=0, concreteness=ratings)
    return tmp_path / "data", summary


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_split_by_story_id(tiny_data):
    data, summary = tiny_data
    train, val, held = (_read(data / f"{n}.jsonl") for n in ("train", "val", "heldout"))
    assert (len(train), len(val), len(held)) == (12, 3, 4)
    ids = {n: [r["story_id"] for r in rs] for n, rs in (("train", train), ("val", val), ("heldout", held))}
    # The last 20% of the ids (1024..1029) are the held-out pool; train and val come from the rest.
    assert all(int(i) >= 1024 for i in ids["heldout"]) and all(int(i) < 1024 for i in ids["train"] + ids["val"])
    assert not set(ids["train"]) & set(ids["val"])
    assert not {"1003", "1013", "1023"} & set(ids["train"] + ids["val"] + ids["heldout"])  # one-sentence stories
    assert summary["left_out_one_sentence"] == {"train": 3, "heldout": 0}
    record = train[0]
    assert record["image_ids"] == [f"{record['story_id']}-{k}" for k in range(1, 6)]
    assert record["story"] == _stories()[record["story_id"]]
    # Concrete words in story order, one per lemma, "saw" left out as a verb; "big" is not concrete enough.
    assert common.story_nouns("we saw a big tree . the kids saw the trees and a kid .", RATINGS) == ["tree", "kids"]
    # Seeded: the same split again.
    again = prepare_data.prepare(data.parent / "gt.json", data.parent / "again", 12, 4, 3, 0.2, 0,
                                 data.parent / "concreteness.csv")
    assert again == {**summary, "stories": again["stories"]}
    assert (data.parent / "again" / "train.jsonl").read_text() == (data / "train.jsonl").read_text()


@pytest.mark.slow
def test_hook_prompts_and_evaluation(tiny_data, tmp_path, monkeypatch):
    import make_albert
    import make_policy
    import train_rl
    from evaluate import evaluate

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.data import build_dataset, load_data, prompt_rows

    data, _ = tiny_data
    train = _read(data / "train.jsonl")
    policy = tmp_path / "policy"
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 128}
    make_policy.pretrain(train, policy, steps=60, batch_size=12, lr=1e-2, size=tiny, log_every=1000)

    # The hook: storyrl's prompt dataset gets each record's nouns, as pretraining and evaluation show them.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy)
    config = RLConfig(algorithm="grpo", model=str(policy), policy="causal_lm", data=str(data / "train.jsonl"),
                      rewards=["repetition"], output_dir=str(tmp_path / "run"))
    import storyrl.training.storyteller.rl.data as rl_data

    uninstall = train_rl.install_hook()
    try:
        assert rl_data.build_dataset is not build_dataset  # wrapped
        rows = rl_data.build_dataset(config, "causal_lm", tokenizer)
        sampled_rows = rl_data.prompt_rows(config, load_data(config), "causal_lm", tokenizer)  # storyrl pairs --policy
    finally:
        uninstall()
    assert rl_data.build_dataset is build_dataset  # the rest of the test session sees storyrl's own
    assert rl_data.prompt_rows is prompt_rows
    assert [r["prompt"] for r in sampled_rows] == [r["prompt"] for r in rows]
    for row, record in zip(rows, train):
        assert row["story_id"] == record["story_id"] and row["reference"] == record["story"]
        assert row["prompt"] == [{"role": "user", "content": common.user_prompt(record["noun_phrases"])}]
    assert common.user_prompt(["dog", "park"]).endswith("five sentences. Things in the images: dog, park.")
    # The chat text the policy was pretrained on is what the trainers and the evaluation render.
    message = [{"role": "user", "content": common.user_prompt(["dog"])}]
    rendered = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    assert rendered == common.chat_text(common.user_prompt(["dog"]))

    # Evaluation: a tiny random coherence model, the start policy against itself and a perturbed copy.
    import torch
    from transformers import AlbertConfig, AutoModelForCausalLM

    from storyrl.models.coherence import CoherenceModel

    albert = tmp_path / "albert"
    make_albert.save_base([r["story"] for r in train], albert, size={
        "embedding_size": 8, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 128})
    torch.manual_seed(0)
    coherence = CoherenceModel.from_config(AlbertConfig.from_pretrained(albert))
    coherence.eval().save_pretrained(tmp_path / "coherence", AutoTokenizer.from_pretrained(albert))
    # Two seeds of a "trained" policy: the start with its head perturbed, as run.sh names them (RUN@SEED).
    moved = {}
    for seed in (0, 1):
        moved[seed] = tmp_path / "runs" / f"moved@{seed}" / "final"
        model = AutoModelForCausalLM.from_pretrained(policy)
        torch.manual_seed(seed)
        with torch.no_grad():
            model.lm_head.weight.add_(0.5 * torch.randn_like(model.lm_head.weight))
        model.save_pretrained(moved[seed])
        tokenizer.save_pretrained(moved[seed])
        (moved[seed].parent / "history.jsonl").write_text("".join(
            json.dumps({"step": s, "reward": 0.5 + 0.01 * s + seed, "kl": 0.001 * s, "entropy": 2.0,
                        "story/distinct_2": 0.5}) + "\n" for s in range(1, 13)))
    out = tmp_path / "eval"
    policies = {"start": str(policy), **{f"moved@{s}": str(d) for s, d in moved.items()}}
    # run.sh's way: the start alone, then each policy in its own process (here: call), then all together
    evaluate(data / "heldout.jsonl", {"start": str(policy)}, str(tmp_path / "coherence"), out, samples=2,
             max_new_tokens=40, report=False)
    assert sorted(p.name for p in (out / "policies").iterdir()) == ["start.json"] and not (out / "results.json").exists()
    evaluate(data / "heldout.jsonl", {"start": str(policy), "moved@0": policies["moved@0"]},
             str(tmp_path / "coherence"), out, samples=2, max_new_tokens=40, report=False)
    assert sorted(p.name for p in (out / "policies").iterdir()) == ["moved@0.json", "start.json"]
    cached = (out / "policies" / "moved@0.json").read_text()
    times = tmp_path / "times.tsv"
    times.write_text("moved@0\t81\tc\t0.1\t0.2\nmoved@1\t82\tc\t0.1\t0.2\n")
    results = evaluate(data / "heldout.jsonl", policies, str(tmp_path / "coherence"), out, samples=2,
                       max_new_tokens=40, runs_dir=tmp_path / "runs", times=times)
    assert (out / "policies" / "moved@0.json").read_text() == cached  # read back, not evaluated again
    assert results["policies"]["moved@1"]["seconds"] == 82.0 and "moved@0 81" in (out / "results.md").read_text()
    start, moved_r = results["policies"]["start"], results["policies"]["moved@0"]
    assert results["n_sequences"] == 4
    assert start["kl"] == pytest.approx(0.0, abs=1e-5) and moved_r["kl"] > 0.01
    assert start["delta"]["delta"] == 0.0
    assert start["n"] > 0 and math.isfinite(start["dhm"])  # the pretrained policy writes scorable stories
    assert start["dhm"] == pytest.approx((start["dhm_coherence"] + start["dhm_repetition"]) / 2)
    assert moved_r["training"]["reward_first"] == pytest.approx(0.555) and moved_r["training"]["steps"] == 12
    assert results["policies"]["moved@1"]["training"]["reward_first"] == pytest.approx(1.555)
    assert "training" not in start or start["training"] is None
    assert len(_read(out / "stories" / "start.jsonl")) == 8
    assert 0.0 <= start["noun_recall"] <= 1.0
    # per-sequence figures, the inputs of the seeds report's checks
    stories = _read(out / "stories" / "moved@1.jsonl")
    for k, record in enumerate(_read(data / "heldout.jsonl")):
        mine = [s for s in stories if s["id"].split("#")[0] == record["story_id"]]
        rep = [s["repetition"] for s in mine if s["repetition"] is not None]
        if rep:
            assert results["policies"]["moved@1"]["per_sequence_scores"]["repetition"][record["story_id"]] == \
                pytest.approx(sum(rep) / len(rep))
    dims = moved_r["per_sequence_dims"]
    assert set(dims) == {"coherence", "repetition"}
    for key, value in moved_r["per_sequence"].items():
        assert value == pytest.approx((dims["coherence"][key] + dims["repetition"][key]) / 2)
    # every figure again from the stories file, written out plainly
    from storyrl.text import tokenize_story

    heldout = {r["story_id"]: r for r in _read(data / "heldout.jsonl")}
    rows = _read(out / "stories" / "moved@0.jsonl")
    assert moved_r["n_rows"] == len(rows) == 8 and len({r["id"] for r in rows}) == 8
    by_sequence = {}
    for r in rows:
        by_sequence.setdefault(r["id"].split("#")[0], []).append(r["story"])
    assert any(len(set(v)) > 1 for v in by_sequence.values())  # the two samples are drawn apart (seed + j)
    assert moved_r["kl"] == pytest.approx(sum(r["kl"] for r in rows) / len(rows))
    recalls = []
    for r in rows:
        wanted = heldout[r["id"].split("#")[0]]["noun_phrases"]
        words = {w.lower() for sentence in tokenize_story(r["story"]) for w in sentence} if r["story"].strip() else set()
        if wanted:
            recalls.append(sum(n.lower() in words for n in wanted) / len(wanted))
    assert moved_r["noun_recall"] == pytest.approx(sum(recalls) / len(recalls))
    for key, stories in by_sequence.items():
        counts = [len(tokenize_story(t)) if t.strip() else 0 for t in stories]
        assert moved_r["per_sequence_sentences"][key] == pytest.approx(sum(counts) / len(counts))
    shared = sorted(set(moved_r["per_sequence"]) & set(start["per_sequence"]))
    assert moved_r["delta"]["delta"] == pytest.approx(
        sum(moved_r["per_sequence"][k] - start["per_sequence"][k] for k in shared) / len(shared))  # moved - start

    # the cache is read back only for the same settings and the same weights
    def evaluated_again(**changes):
        before = (out / "policies" / "moved@0.json").read_text()
        kwargs = {"samples": 2, "max_new_tokens": 40, **changes}
        evaluate(data / "heldout.jsonl", {"start": str(policy), "moved@0": policies["moved@0"]},
                 str(tmp_path / "coherence"), out, report=False, **kwargs)
        return (out / "policies" / "moved@0.json").read_text() != before

    assert not evaluated_again()
    assert evaluated_again(samples=1) and evaluated_again(samples=2)
    assert evaluated_again(seed=1) and evaluated_again(seed=0)
    weights = next(moved[0].glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # retrained in place
    assert evaluated_again() and not evaluated_again()

    # evaluate.py --no-report: the policy's file only, no table
    import evaluate as evaluate_module

    (out / "policies" / "moved@1.json").unlink()
    table_before = (out / "results.json").stat().st_mtime_ns
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--heldout", str(data / "heldout.jsonl"), "--coherence-model",
                                      str(tmp_path / "coherence"), "--out", str(out), "--policy", f"start={policy}",
                                      "--policy", f"moved@1={policies['moved@1']}", "--max-new-tokens", "40",
                                      "--no-report"])
    evaluate_module.main()
    assert (out / "policies" / "moved@1.json").is_file() and (out / "results.json").stat().st_mtime_ns == table_before

    from evaluate import noun_recall, per_sequence_means

    assert noun_recall(["the dog ran to the park.", "a cat."], [["dog", "tree"], []]) == 0.5
    assert per_sequence_means(["a#0", "a#1", "b#0", "c"], [0.5, float("nan"), float("nan"), 0.25]) == {"a": 0.5,
                                                                                                     "c": 0.25}
    table = (out / "results.md").read_text()
    assert "| human (held-out) |" in table and "| moved@1 |" in table
    assert (out / "results.png").stat().st_size > 1000
    assert json.loads((out / "results.json").read_text())["start"] == "start"

    # The seeds report and the README block from these results
    import report

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    block = report.report(out / "results.json", out, readme=readme)
    text = readme.read_text()
    assert text.startswith(f"intro\n{report.BEGIN}\n") and text.endswith(f"{report.END}\nafter\n")
    assert report.read_block(readme) == block and "| moved | 2 |" in block
    assert (tmp_path / "results.png").read_bytes() == (out / "results.png").read_bytes()  # the README's picture
    assert (out / "results.png").stat().st_size > 1000 and json.loads((out / "seeds.json").read_text())["claims"]


# The shipped results.png's figures (README table: d_HM coh., d_HM rep., d_HM, KL, delta [CI]).
SHIPPED = {"start": (0.0950, 0.0570, 0.0760, 0.0, 0.0, 0.0, 0.0),
           "ppo_dhm": (0.0831, 0.0467, 0.0649, 7.18, -0.0111, -0.0159, -0.0064),
           "grpo_dhm": (0.0853, 0.0462, 0.0657, 1.26, -0.0103, -0.0148, -0.0058),
           "rloo_dhm": (0.0871, 0.0458, 0.0664, 3.78, -0.0095, -0.0150, -0.0040),
           "ppo_repetition": (0.0895, 0.0453, 0.0674, 9.49, -0.0086, -0.0147, -0.0019),
           "grpo_repetition": (0.0890, 0.0432, 0.0661, 3.19, -0.0099, -0.0148, -0.0048),
           "rloo_repetition": (0.0976, 0.0457, 0.0716, 6.38, -0.0044, -0.0104, 0.0015),
           "dpo_dhm": (0.0835, 0.0435, 0.0635, 5.53, -0.0125, -0.0178, -0.0072)}


def _shipped_results() -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    policies = {}
    for k, (name, (coh, rep, dhm, kl, delta, low, high)) in enumerate(SHIPPED.items()):
        entry = {"dhm_coherence": coh, "dhm_repetition": rep, "dhm": dhm, "kl": kl,
                 "delta": {"delta": delta, "low": low, "high": high}, "training": None}
        if name == "dpo_dhm":  # a few monitoring points, as DPO logs them
            entry["training"] = {"curve_steps": list(range(10, 90, 10)),
                                 "curve": [-0.11, -0.135, -0.135, -0.136, -0.13, -0.125, -0.128, -0.127]}
        elif name != "start":  # 80 logged steps of a noisy rising reward
            entry["training"] = {"curve": list(0.9 * (k % 2) - 0.07 + np.cumsum(rng.normal(0.0004 * k, 0.004, 80)))}
        policies[name] = entry
    return {"label": "held-out", "start": "start", "policies": policies}


def test_results_png_legends_cover_no_data(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from evaluate import plot
    from matplotlib.figure import Figure
    from test_plots_layout import inside_figure, overlaps

    saved = []
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):  # the figure plot() writes, to measure after it is closed
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot(_shipped_results(), tmp_path / "results.png")
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    fig = saved[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)  # closing it left a canvas that cannot draw
    try:
        assert [ax.get_title() for ax in fig.axes] == ["held-out d_HM per dimension", "training reward",
                                                      "held-out improvement vs drift"]
        assert overlaps(fig) == [] and inside_figure(fig)
    finally:
        plt.close(fig)


def _run(args, cwd, env_extra) -> "subprocess.CompletedProcess":
    import os
    import subprocess

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "VIRTUAL_ENV": "set",
           **env_extra}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_run_sh_without_its_data_says_which_file_and_where_to_get_it(tmp_path):
    import shutil

    # A copy of the example in a scratch checkout: run.sh works from its repository root (here tmp_path).
    shutil.copytree(EXAMPLE, tmp_path / "examples" / "rl_vist")
    script = str(tmp_path / "examples" / "rl_vist" / "run.sh")
    missing = tmp_path / "nowhere" / "gt_test.json"
    result = _run(["bash", script], tmp_path, {"STORYRL_VIST_STORIES": str(missing)})
    assert result.returncode == 1
    output = (result.stdout + result.stderr).strip()
    assert "\n" not in output and "Traceback" not in output, output
    assert str(missing) in output and "STORYRL_VIST_STORIES" in output
    assert "https://github.com/akskuchi/dHM-visual-storytelling" in output
    assert not (tmp_path / "out").exists()  # nothing ran before the check
    missing.parent.mkdir()
    missing.write_text("{}")
    result = _run(["bash", script], tmp_path, {"STORYRL_VIST_STORIES": str(missing),
                                               "STORYRL_CONCRETENESS": str(tmp_path / "no.csv")})
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1 and "\n" not in output and str(tmp_path / "no.csv") in output, output

    # prepare_data.py on its own: one line too
    result = _run([sys.executable, str(EXAMPLE / "prepare_data.py"), str(tmp_path / "data"), "--stories",
                   str(tmp_path / "absent.json")], tmp_path, {})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"prepare_data.py: --stories: no such file: {tmp_path / 'absent.json'} (set "
                                     "--stories or $STORYRL_VIST_STORIES; where to get it: examples/rl_vist/README.md)")


def test_vist_spacing_inverts_the_decoder():
    from tokenizers import decoders

    # VIST-tokenized words as the policy samples them; its decoder glues punctuation and clitics on.
    words = ["we", "did", "n't", "go", ".", "it", "'s", "my", "mom", "'s", "car", ",", "i", "'m", "sure", "!",
             "they", "'ve", "left", "?", "we", "'re", "here", ".", "."]
    decoded = decoders.WordPiece(cleanup=True).decode(words)
    assert decoded == "we didn't go. it's my mom's car, i'm sure! they've left? we're here.."
    assert common.vist_spacing(decoded) == " ".join(words)
    assert common.vist_spacing("the dog ran .") == "the dog ran ."  # already spaced: unchanged
    assert common.vist_spacing("mr. smith's") == "mr . smith 's"
    assert common.vist_spacing("'s fine") == "'s fine"  # nothing before it to split from


def test_space_pairs(tmp_path):
    import csv

    import space_pairs

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"story_id": i, "story": s}) + "\n"
                            for i, s in (("7", "the dog ran ."), ("8", "a cat sat ."))))
    pairs = tmp_path / "pairs.jsonl"
    prompt = [{"role": "user", "content": "tell. a story"}]
    rows = [{"prompt": prompt, "chosen": "we ran. it's fun.", "rejected": "no, we sat.", "story_id": "7",
             "chosen_score": -0.1, "rejected_score": -0.3, "margin": 0.2},
            {"prompt": prompt, "chosen": "a cat.", "rejected": "we sat.", "story_id": "8",
             "chosen_score": -0.2, "rejected_score": -0.25, "margin": 0.05}]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, scores = tmp_path / "spaced.jsonl", tmp_path / "scores.csv"
    assert space_pairs.space_pairs(pairs, out, data, scores) == 2
    got = _read(out)
    assert [(g["chosen"], g["rejected"]) for g in got] == [("we ran . it 's fun .", "no , we sat ."),
                                                          ("a cat .", "we sat .")]
    assert got[0]["prompt"] == prompt and got[0]["margin"] == 0.2  # everything else kept, the prompt unspaced
    assert [g["reference"] for g in got] == ["the dog ran .", "a cat sat ."]
    table = {r["story_id"]: (float(r["labels"]), int(r["shorter"])) for r in csv.DictReader(scores.open())}
    assert table[got[0]["better_id"]] == (-0.1, -7) and table[got[0]["worse_id"]] == (-0.3, -5)  # spaced tokens
    assert table[got[1]["worse_id"]] == (-0.25, -3) and got[1]["better_id"].startswith("8:")
    assert len(table) == 4
    # Without --data and --scores: only the spacing.
    space_pairs.space_pairs(pairs, out)
    assert "reference" not in _read(out)[0] and "better_id" not in _read(out)[0]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"story_id": "9", "story": "x ."}) + "\n")
    with pytest.raises(SystemExit, match="story_id '7' is not in"):
        space_pairs.space_pairs(pairs, out, other)


def test_dpo_training_figures(tmp_path):
    from evaluate import training_figures

    # A DPO history: a loss every step, the monitoring stories' rewards every 2 steps (8 logs, quarter = 2).
    history = tmp_path / "history.jsonl"
    lines = []
    for step in range(1, 17):
        row = {"step": step, "loss": 0.69 - 0.01 * step, "entropy": 4.0, "rewards/chosen": 0.1}
        if step % 2 == 0:
            row.update({"rewards/dhm/mean": -0.1 + 0.001 * step, "story/distinct_2": 0.5,
                        "story/sentences_mean": 5.0 + 0.1 * step})
        lines.append(json.dumps(row) + "\n")
    history.write_text("".join(lines))
    t = training_figures(history)
    assert t["steps"] == 16 and t["monitor"] == "rewards/dhm/mean"
    assert t["reward_first"] == pytest.approx(-0.097) and t["reward_last"] == pytest.approx(-0.085)  # steps 2,4 / 14,16
    assert t["sentences_first"] == pytest.approx(5.3) and t["sentences_last"] == pytest.approx(6.5)
    assert "entropy_first" not in t and "kl_first" not in t
    assert t["curve_steps"] == [2, 4, 6, 8, 10, 12, 14, 16] and t["curve"][0] == pytest.approx(-0.098)


def test_example_configs_load(tmp_path):
    from transformers import LlamaConfig

    from storyrl.training.storyteller.dpo import DPORunConfig
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig

    model = tmp_path / "policy"
    LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(model)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("{}\n")
    data = tmp_path / "train.jsonl"  # out/rl_vist/ exists only after run.sh
    data.write_text("{}\n")
    paths = {"pairs": str(pairs), "model": str(model)}
    dpo = DPORunConfig.from_yaml(EXAMPLE / "dpo_dhm.yaml", output_dir=str(tmp_path / "dpo"), data=str(data), **paths)
    assert (dpo.prompts, dpo.max_steps, dpo.batch_size, dpo.lora.enabled) == ("pairs", 80, 16, False)
    assert dpo.rewards == ["examples/rl_vist/dhm.yaml"] and dpo.sample_steps == 10
    rm = RewardModelRunConfig.from_yaml(EXAMPLE / "reward_model_dhm.yaml", output_dir=str(tmp_path / "rm"), **paths)
    assert rm.include_prompt is False and rm.lora.enabled is False
    with pytest.raises(ValueError, match="dpo_dhm.yaml: .*pairs: no such file"):
        DPORunConfig.from_yaml(EXAMPLE / "dpo_dhm.yaml", output_dir=str(tmp_path / "dpo"), model=str(model),
                               data=str(data), pairs=str(tmp_path / "missing.jsonl"))
