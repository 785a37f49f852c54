"""Vrank: the model, the reward (compare / score / rank, TRL contract) and the
trainer on synthetic VHED-format CSVs, with a tiny random BERT and a WordPiece
tokenizer built here (tests/tiny_models.py)."""

from __future__ import annotations

import csv
import json
import math
import pickle
import random

import storyrl  # noqa: F401  (before torch/transformers: CPU torchvision fallback)

import numpy as np
import pytest
import torch
from tiny_models import bert_wordpiece_tokenizer, vrank_model

from storyrl.judgements import JudgementDataError
from storyrl.judgements.vhed import VHED_COLUMNS
from storyrl.rewards import create_reward, load_reward_config
from storyrl.rewards.base import RewardError
from storyrl.training.judges.vrank import (
    VrankTrainConfig,
    pair_examples,
    split_by_image_sequence,
    train_vrank,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")

SUBJECTS = ["the dog", "a girl", "my family", "the boy", "our team", "the old man"]
ACTIONS = ["went to the park", "ate some cake", "played with a ball", "saw the sea", "sang a song",
           "walked home", "took a photo", "met a friend"]
WORDS = sorted({w for t in SUBJECTS + ACTIONS for w in t.split()})


def good_story(rng: random.Random) -> str:
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} ." for _ in range(rng.randint(2, 4)))


def bad_story(rng: random.Random) -> str:
    # Repetitive: one word over and over (the learnable fault).
    return " ".join([rng.choice(WORDS)] * rng.randint(5, 14)) + " ."


VOCAB_TEXTS = [" ".join(SUBJECTS + ACTIONS) + " ."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bert_wordpiece_tokenizer(VOCAB_TEXTS, tmp_path_factory.mktemp("tok"))


def scaled_model(tokenizer, seed=0):
    """A random model with large initial weights (BERT's 0.02 gives nearly
    the same [CLS] vector for every input) and an unbiased head, so that
    predictions vary in sign."""
    model = vrank_model(len(tokenizer), seed=seed, initializer_range=0.5).eval()
    with torch.no_grad():
        model.head.bias.zero_()
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("vrank") / "model"
    scaled_model(tokenizer).save_pretrained(directory, tokenizer)
    return str(directory)


def stories(n, seed=0):
    rng = random.Random(seed)
    return [good_story(rng) if k % 2 else bad_story(rng) for k in range(n)]


def write_vhed(path, n_seq=24, pairs_per_seq=3, seed=0, extra=None):
    """A VHED-format CSV (all 12 columns): per image sequence, pairs of a good
    and a repetitive story in random order; gap < 0 iff sent1 is the good one."""
    rng = random.Random(seed)
    rows = []
    for s in range(n_seq):
        for k in range(pairs_per_seq):
            good, bad = good_story(rng), bad_story(rng)
            first_good = rng.random() < 0.5
            gap = -rng.choice([0.25, 0.5, 0.75]) if first_good else rng.choice([0.25, 0.5, 0.75])
            rows.append({
                "sent1": good if first_good else bad, "sent2": bad if first_good else good, "label": gap,
                "story_id": f"{s}-{k}", "model_base": "gt" if first_good else "aREL", "model_comp": "glac",
                "agreement": rng.choice([2, 3, 4, 5]), "img_seq": f"seq{s}", "avg_rank_base": 0.4,
                "avg_rank_comp": 0.4 - gap, "order": 5, "rank_norm": gap / 2,
            })
    rows.extend(extra or [])
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(VHED_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def reward(model_dir, **options):
    return create_reward("vrank", model=model_dir, device="cpu", precision="fp32", **options)


# -- the model and the reward ------------------------------------------------------------


def independent_gaps(model, tokenizer, firsts, seconds):
    """avg_rank(first) - avg_rank(second) computed pair by pair from the
    encoder's last layer: BERT's pooler (dense + tanh) on [CLS], then the head."""
    out = []
    with torch.no_grad():
        for a, b in zip(firsts, seconds):
            enc = tokenizer(a, b, return_tensors="pt")
            cls = model.encoder(**enc).last_hidden_state[0, 0]
            pooled = torch.tanh(model.encoder.pooler.dense.weight @ cls + model.encoder.pooler.dense.bias)
            out.append(float(model.head.weight[0] @ pooled + model.head.bias[0]))
    return np.array(out)


def test_compare_sign_and_reference(model_dir, tokenizer):
    from storyrl.models.vrank import VrankModel

    net, tok = VrankModel.from_pretrained(model_dir)
    a, b = stories(6, seed=1), stories(6, seed=2)[::-1]
    gaps = independent_gaps(net, tok, a, b)
    assert np.ptp(gaps) > 0.1 and (gaps > 0).any() and (gaps < 0).any()  # a meaningful fixture
    r = reward(model_dir)
    # Positive = first better = negative predicted gap.
    np.testing.assert_allclose(r.compare(a, b), -gaps, atol=1e-5)
    # The model reads one order: swapping gives the other order's prediction.
    np.testing.assert_allclose(r.compare(b, a), -independent_gaps(net, tok, b, a), atol=1e-5)
    sym = reward(model_dir, symmetric=True).compare(a, b)
    np.testing.assert_allclose(sym, (independent_gaps(net, tok, b, a) - gaps) / 2, atol=1e-5)
    np.testing.assert_allclose(reward(model_dir, symmetric=True).compare(b, a), -sym, atol=1e-6)
    # score = compare against the reference.
    np.testing.assert_allclose(r.score(a, reference=b), -gaps, atol=1e-5)


def test_batched_equals_one_by_one_and_reload(model_dir, tmp_path):
    a, b = stories(7, seed=3), stories(7, seed=4)
    batched = reward(model_dir, batch_size=3).compare(a, b)
    one = np.array([reward(model_dir, batch_size=1).compare([x], [y])[0] for x, y in zip(a, b)])
    np.testing.assert_allclose(batched, one, atol=1e-5)
    # Saved again and reloaded: identical scores.
    from storyrl.models.vrank import VrankModel

    net, tok = VrankModel.from_pretrained(model_dir)
    net.save_pretrained(tmp_path / "again", tok)
    np.testing.assert_array_equal(reward(str(tmp_path / "again"), batch_size=3).compare(a, b), batched)


def test_truncation_keeps_both_stories(tokenizer):
    from storyrl.models.vrank import encode_story_pairs

    long_a, short_b = " ".join(["dog"] * 100), "the girl sang ."
    enc = encode_story_pairs(tokenizer, [long_a], [short_b], max_length=16)
    ids = enc["input_ids"][0].tolist()
    assert len(ids) == 16 and ids.count(tokenizer.sep_token_id) == 2
    # longest_first cuts the long story only: the short one is whole.
    assert ids[ids.index(tokenizer.sep_token_id) + 1 : -1] == tokenizer(short_b, add_special_tokens=False)["input_ids"]
    # Two long stories share the room: each keeps (16 - 3) / 2 tokens, give or take one.
    enc = encode_story_pairs(tokenizer, [long_a], [" ".join(["girl"] * 100)], max_length=16)
    types = enc["token_type_ids"][0].tolist()
    assert len(types) == 16 and abs((types.count(0) - 2) - (types.count(1) - 1)) <= 1


def test_rank_against_independent_preferences(model_dir, tokenizer):
    from storyrl.models.vrank import VrankModel

    net, tok = VrankModel.from_pretrained(model_dir)
    group = stories(5, seed=5)
    n = len(group)
    gap = {(i, j): independent_gaps(net, tok, [group[i]], [group[j]])[0] for i in range(n) for j in range(n) if i != j}
    prefs = np.array([np.mean([(gap[(j, i)] - gap[(i, j)]) / 2 for j in range(n) if j != i]) for i in range(n)])
    r = reward(model_dir, batch_size=4)
    np.testing.assert_allclose(r.preference_scores(group), prefs, atol=1e-5)
    assert r.rank(group) == sorted(range(n), key=lambda i: -prefs[i])
    # An unscorable candidate goes last; ties keep index order.
    assert r.rank([group[0], "", group[1]])[-1] == 1
    assert r.rank([group[0], group[0]]) == [0, 1]
    assert r.rank([group[2]]) == [0] and r.rank([]) == []


def test_trl_contract_missing_reference_and_pickling(model_dir):
    a, refs = stories(4, seed=6), stories(4, seed=7)
    r = reward(model_dir)
    assert r.__name__ == "vrank"
    expected = r.score(a, reference=refs)
    out = r(prompts=["p"] * 4, completions=a, reference=[refs[0], None, "", refs[3]])
    assert out[1] is None and out[2] is None
    assert out[0] == pytest.approx(expected[0], abs=1e-6) and out[3] == pytest.approx(expected[3], abs=1e-6)
    assert r.stats["reasons"]["reference missing or empty"] == 2
    assert np.isnan(r.score(a)).all() and r.stats["reasons"]["no reference story (context 'reference')"] == 4
    assert math.isnan(r.compare([a[0]], [None])[0])
    copy = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(copy.score(a, reference=refs), expected)


def test_config_errors(model_dir, tmp_path):
    with pytest.raises(TypeError, match="max_length"):
        create_reward("vrank", model=model_dir, max_length="512")
    with pytest.raises(TypeError, match="symmetric"):
        create_reward("vrank", model=model_dir, symmetric="yes")
    with pytest.raises(RewardError, match="trained model"):
        create_reward("vrank").setup()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Exception, match="not a storyrl Vrank model") as info:
        create_reward("vrank", model=str(empty)).setup()
    assert "\n" not in str(info.value)
    with pytest.raises(Exception, match="not found"):
        create_reward("vrank", model=str(tmp_path / "missing")).setup()
    with pytest.raises(ValueError, match="lengths|second stories"):
        reward(model_dir).compare(["a"], ["b", "c"])
    with pytest.raises(ValueError, match="train_csv"):
        VrankTrainConfig(output_dir="o")
    with pytest.raises(ValueError, match="not both"):
        VrankTrainConfig(output_dir="o", vhed="a.csv", train_csv="b.csv")
    with pytest.raises(ValueError, match="target"):
        VrankTrainConfig(output_dir="o", vhed="a.csv", target="gap")
    with pytest.raises(TypeError, match="lr"):
        VrankTrainConfig(output_dir="o", vhed="a.csv", lr="1e-3")


def test_config_files(tmp_path, model_dir):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    config = VrankTrainConfig.from_yaml(repo / "configs" / "training" / "vrank.yaml", output_dir=str(tmp_path))
    # The paper's settings (VHED App.).
    assert (config.lr, config.epochs, config.batch_size, config.seed) == (2e-5, 30, 32, 7777)
    assert (config.optimizer, config.weight_decay, config.lr_decay, config.mixed_precision) == ("adam", 0.0, 1.0, "auto")
    assert config.base_model == "princeton-nlp/sup-simcse-bert-base-uncased" and config.target == "label"
    r = load_reward_config(repo / "configs" / "rewards" / "vrank.yaml", {"model": model_dir})
    assert r.name == "vrank" and r.model == model_dir and r.symmetric is False


# -- training ---------------------------------------------------------------------------


def test_split_and_pair_examples(tmp_path):
    from storyrl.judgements.vhed import load_vhed

    pairs = load_vhed(write_vhed(tmp_path / "v.csv", n_seq=20, pairs_per_seq=2)).pairs
    train, val, test = split_by_image_sequence(pairs, 0.1, 0.1, seed=3)
    sides = [{p.img_seq for p in part} for part in (train, val, test)]
    assert [len(s) for s in sides] == [16, 2, 2] and not (sides[0] & sides[1] or sides[0] & sides[2] or sides[1] & sides[2])
    assert len(train) + len(val) + len(test) == len(pairs) and train == [p for p in pairs if p.img_seq in sides[0]]
    assert split_by_image_sequence(pairs, 0.1, 0.1, seed=3) == (train, val, test)
    examples = pair_examples(pairs[:2], "label", both_orders=True)
    p = pairs[0]
    assert examples[:2] == [(p.story1, p.story2, p.gap, np.sign(p.gap)), (p.story2, p.story1, -p.gap, -np.sign(p.gap))]
    assert len(examples) == 4 and pair_examples(pairs[:2], "rank_norm")[0][2] == p.rank_norm
    # A pair already present in the other order is not added twice.
    swapped = type(p)(**{**p.__dict__, "story1": p.story2, "story2": p.story1, "gap": -p.gap})
    assert len(pair_examples([p, swapped], both_orders=True)) == 2


def train_config(tmp_path, csv_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "run"), vhed=csv_path, epochs=3, batch_size=16, lr=1e-3,
                    max_length=64, patience=3, seed=0, base_model="unreachable/never-loaded")
    return VrankTrainConfig(**{**settings, **overrides})


def test_train_end_to_end(tmp_path, tokenizer):
    from storyrl.judgements.vhed import load_vhed

    csv_path = write_vhed(tmp_path / "vhed.csv")
    config = train_config(tmp_path, csv_path, epochs=5, patience=5)
    model = vrank_model(len(tokenizer), seed=1)
    result = train_vrank(config, progress=False, model=model, tokenizer=tokenizer)
    history = result.history
    assert result.epochs_run == 5 and len(history) == 5
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert all("val_acc" in r and "train_acc" in r for r in history)
    assert history[-1]["train_acc"] > 0.9 and max(r["val_acc"] for r in history) > 0.75  # learnt, beyond chance
    # best/ is the epoch of the highest validation accuracy (first one on ties).
    accs = [r["val_acc"] for r in history]
    assert result.monitor == "val_acc" and result.best_epoch == accs.index(max(accs)) + 1
    assert result.best_metric == max(accs) and result.best_val_loss == history[result.best_epoch - 1]["val_loss"]

    # The trained directory as the reward reproduces the best epoch's accuracy,
    # counted here from the human gaps of the validation split.
    _, val, test = split_by_image_sequence(load_vhed(csv_path).pairs, 0.1, 0.1, seed=0)
    r = create_reward("vrank", model=str(tmp_path / "run" / "best"), device="cpu", precision="fp32")
    pref = r.compare([p.story1 for p in val], [p.story2 for p in val])
    human = np.array([-np.sign(p.gap) for p in val])  # positive = story1 better
    assert np.mean(np.sign(pref) == human) == pytest.approx(max(accs))
    metrics = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    pref = r.compare([p.story1 for p in test], [p.story2 for p in test])
    assert metrics["n"] == len(test) and metrics["acc"] == pytest.approx(
        np.mean(np.sign(pref) == [-np.sign(p.gap) for p in test]))
    assert VrankTrainConfig.from_yaml(tmp_path / "run" / "config.yaml") == config


def test_resume_equals_uninterrupted(tmp_path, tokenizer):
    csv_path = write_vhed(tmp_path / "vhed.csv", n_seq=12, pairs_per_seq=2, seed=2)
    full = train_vrank(train_config(tmp_path / "a", csv_path, epochs=2), progress=False,
                       model=vrank_model(len(tokenizer), seed=1), tokenizer=tokenizer)
    # Stopped inside the second epoch (after the first's checkpoint and best/), then resumed to the end.
    steps_per_epoch = full.history[0]["step"]
    train_vrank(train_config(tmp_path / "b", csv_path, epochs=2, max_steps=steps_per_epoch + 1), progress=False,
                model=vrank_model(len(tokenizer), seed=1), tokenizer=tokenizer)
    resumed = train_vrank(train_config(tmp_path / "b", csv_path, epochs=2), resume=True, progress=False,
                          model=vrank_model(len(tokenizer), seed=1), tokenizer=tokenizer)
    assert len(resumed.history) == len(full.history) == 2
    for got, want in zip(resumed.history, full.history):
        assert {k: v for k, v in got.items() if k != "seconds"} == pytest.approx(
            {k: v for k, v in want.items() if k != "seconds"}, rel=1e-5)
    assert (resumed.best_epoch, resumed.best_metric) == (full.best_epoch, full.best_metric)
    states = [json.loads((tmp_path / x / "run" / "last" / "trainer_state.json").read_text()) for x in "ab"]
    keys = ("best_metric", "best_val_loss", "best_epoch", "bad_epochs", "epoch", "global_step")
    assert [states[1][k] for k in keys] == pytest.approx([states[0][k] for k in keys])
    a, b = stories(4, seed=8), stories(4, seed=9)
    np.testing.assert_allclose(
        reward(str(tmp_path / "b" / "run" / "best")).compare(a, b),
        reward(str(tmp_path / "a" / "run" / "best")).compare(a, b), atol=1e-5)


def test_training_data_errors(tmp_path, tokenizer):
    bad = write_vhed(tmp_path / "bad.csv", n_seq=3, extra=[{c: "3" for c in VHED_COLUMNS} | {"label": "abc"}])
    with pytest.raises(JudgementDataError, match=r"bad.csv: row 10: column 'label'") as info:
        train_vrank(train_config(tmp_path, bad), progress=False, model=vrank_model(len(tokenizer)), tokenizer=tokenizer)
    assert "\n" not in str(info.value)
    few = write_vhed(tmp_path / "few.csv", n_seq=1, pairs_per_seq=2)
    with pytest.raises(ValueError, match="too few"):
        train_vrank(train_config(tmp_path, few), progress=False, model=vrank_model(len(tokenizer)), tokenizer=tokenizer)


def test_train_command_line(tmp_path, tokenizer):
    """`storyrl train vrank --config ...` as users run it, from a saved tiny
    model (init_from), on separate train/val CSVs."""
    from click.testing import CliRunner

    from storyrl.cli import main

    start = tmp_path / "start"
    vrank_model(len(tokenizer), seed=2).save_pretrained(start, tokenizer)
    train_csv = write_vhed(tmp_path / "train.csv", n_seq=6, pairs_per_seq=2, seed=3)
    val_csv = write_vhed(tmp_path / "val.csv", n_seq=2, pairs_per_seq=2, seed=4)
    config = tmp_path / "train.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'run'}\ntrain_csv: {train_csv}\nval_csv: {val_csv}\ninit_from: {start}\n"
        "epochs: 1\nbatch_size: 8\nlr: 0.001\nmax_length: 64\n"
    )
    result = CliRunner().invoke(main, ["train", "vrank", "--config", str(config), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["epochs_run"] == 1
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert summary["val_acc"] == max(h["val_acc"] for h in history)  # what chose best/, not only the loss
    r = create_reward("vrank", model=str(tmp_path / "run" / "best"), device="cpu")
    assert np.isfinite(r.compare(["the dog sang a song ."], ["dog dog dog ."])).all()


def test_meta_eval_pairs_with_vrank(model_dir, tmp_path):
    """`storyrl meta-eval pairs --vhed ... -m vrank`: the pairwise path
    (compare) end to end; accuracies recomputed from the encoder by hand."""
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.models.vrank import VrankModel

    csv_path = write_vhed(tmp_path / "vhed.csv", n_seq=4, pairs_per_seq=3, seed=5)
    with open(csv_path, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    net, tok = VrankModel.from_pretrained(model_dir)
    predicted = independent_gaps(net, tok, [r["sent1"] for r in rows], [r["sent2"] for r in rows])
    # Correct iff the predicted gap has the human gap's sign (agreement 2 reads as 3).
    correct = [(p < 0) == (float(r["label"]) < 0) and p != 0 for p, r in zip(predicted, rows)]
    agreement = [max(int(r["agreement"]), 3) for r in rows]
    out = tmp_path / "table.csv"
    result = CliRunner().invoke(main, ["meta-eval", "pairs", "--vhed", csv_path, "-m", "vrank",
                                       "--vrank-model", model_dir, "--device", "cpu", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    with open(out, encoding="utf-8") as f:
        table = {r["subset"]: r for r in csv.DictReader(f) if r["metric"] == "vrank"}
    for subset, keep in {"all": lambda k: True, "Ω3": lambda k: k == 3, "Ω{4,5}": lambda k: k >= 4}.items():
        picked = [c for c, k in zip(correct, agreement) if keep(k)]
        if picked:
            assert int(table[subset]["n"]) == len(picked)
            assert float(table[subset]["accuracy"]) == pytest.approx(sum(picked) / len(picked), abs=1e-9)
