"""storyrl meta-eval: pair accuracy per subset (ties, NaN, subsets, gap
buckets, the reference-absent rule, pairwise compare, precomputed columns),
correlations with ratings against scipy, bootstrap, system-level τ, original
vs random, and the command line end to end. Model-free: fake metrics and
``repetition``."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

import storyrl  # noqa: F401
from storyrl.cli import main
from storyrl.eval.meta_eval import Metric, original_vs_random_table, pairs_table, ratings_table
from storyrl.eval.meta_eval_stats import bootstrap_ci, correlations, pair_correct, system_means
from storyrl.judgements.pairs import PreferencePair, load_pairs_jsonl, vhed_pairs
from storyrl.judgements.ratings import load_ratings
from storyrl.judgements.vhed import VHED_COLUMNS, load_vhed


class Lookup:
    """Scores each story from a table (missing -> NaN); records every call."""

    name = "lookup"

    def __init__(self, table, name="lookup"):
        self.table, self.name, self.calls = table, name, []

    def score(self, stories, **context):
        self.calls.append((list(stories), context))
        return np.array([self.table.get(s, math.nan) for s in stories], dtype=np.float64)


def rows_of(result):
    return {(r[0], r[1]): r for r in result.rows}


# -- pair accuracy ----------------------------------------------------------------

def test_pair_correct_ties_and_nan_are_wrong():
    got = pair_correct([2, 1, 1, np.nan, 3], [1, 2, 1, 0, np.nan])
    assert got.tolist() == [True, False, False, False, False]
    assert pair_correct([0.5, 0.0, -1, np.nan]).tolist() == [True, False, False, False]


def test_pairs_accuracy_per_subset_by_hand():
    pairs = [
        PreferencePair("a", "b", subsets=("x",)),      # 3 > 1 correct
        PreferencePair("b", "a", subsets=("x", "y")),  # wrong
        PreferencePair("a", "c", subsets=("y",)),      # tie: wrong
        PreferencePair("d", "b", subsets=("y",)),      # NaN: wrong
        PreferencePair("c", "b"),                      # 3 > 1 correct
    ]
    metric = Lookup({"a": 3.0, "b": 1.0, "c": 3.0})
    result = pairs_table(pairs, [Metric("m", reward=metric)], progress=False)
    got = rows_of(result)
    assert got[("all", "m")][2:] == [5, 2 / 5]
    assert got[("x", "m")][2:] == [2, 1 / 2]
    assert got[("y", "m")][2:] == [3, 0.0]
    assert [r[0] for r in result.rows] == ["all", "x", "y"]
    assert result.unscorable == {"m": 1} and result.succeeded == ["m"]
    # every distinct story text scored once, in one batch
    (texts, _), = metric.calls
    assert sorted(texts) == ["a", "b", "c", "d"]


def test_all_nan_metric_fails_and_others_go_on():
    class Broken:
        name = "broken"

        def score(self, stories, **context):
            raise RuntimeError("model exploded\nsecond line")

    pairs = [PreferencePair("a", "b")]
    result = pairs_table(pairs, [Metric("nan", reward=Lookup({})), Metric("broken", reward=Broken()),
                                 Metric("ok", reward=Lookup({"a": 1, "b": 0}))], progress=False)
    assert result.failed["nan"].startswith("no pair could be scored")
    assert result.failed["broken"] == "model exploded second line"
    assert [r[1] for r in result.rows] == ["ok"] and not result.all_failed
    only_bad = pairs_table(pairs, [Metric("nan", reward=Lookup({}))], progress=False)
    assert only_bad.all_failed


def test_pairwise_metric_uses_compare():
    class Pairwise:
        name = "pw"

        def __init__(self):
            self.seen = []

        def compare(self, first, second, **context):
            self.seen.append(context)
            return np.array([len(a) - len(b) if a != "nan" else np.nan for a, b in zip(first, second)], float)

        def score(self, stories, **context):  # must not be used
            raise AssertionError("score() used for a pairwise metric")

    pairs = [PreferencePair("long story", "short", story_id="s1"), PreferencePair("ab", "ab"),
             PreferencePair("x", "longer"), PreferencePair("nan", "y")]
    reward = Pairwise()
    result = pairs_table(pairs, [Metric("pw", reward=reward)], progress=False)
    assert rows_of(result)[("all", "pw")][2:] == [4, 1 / 4]
    assert result.unscorable == {"pw": 1}
    assert reward.seen[0]["story_id"] == ["s1", None, None, None]


def test_precomputed_columns_by_story_ids(tmp_path):
    pairs = [PreferencePair("a", "b", better_id="1", worse_id="2"),
             PreferencePair("c", "d", better_id="3", worse_id="1")]
    result = pairs_table(pairs, [Metric("col", scores={"1": 0.5, "2": 0.1, "3": 0.5})], progress=False)
    assert rows_of(result)[("all", "col")][2:] == [2, 0.5]  # second is a tie
    bad = pairs_table([PreferencePair("a", "b")], [Metric("col", scores={})], progress=False)
    assert "better_id" in bad.failed["col"]


# -- VHED subsets, buckets, references ----------------------------------------

def write_vhed(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=VHED_COLUMNS)
        writer.writeheader()
        for k, r in enumerate(rows):
            s1, s2, label, m1, m2, agreement, seq = r
            writer.writerow(dict(sent1=s1, sent2=s2, label=label, story_id=f"t{k}", model_base=m1, model_comp=m2,
                                 agreement=agreement, img_seq=seq, avg_rank_base="0.5", avg_rank_comp="0.5",
                                 order="5", rank_norm="0.0"))
    return path


VHED_ROWS = [
    # story1, story2, gap, model1, model2, agreement, img_seq
    ("ref one", "mach a", -0.1, "reference", "AREL", 4, "seq1"),   # R&M, bucket 1 (edge), better ref one
    ("mach a", "mach b", 0.2, "AREL", "GLAC", 5, "seq1"),          # M&M, bucket 2 (edge), better mach b
    ("mach b", "ref one", 0.35, "GLAC", "human", 5, "seq1"),        # R&M, bucket 4, better ref one
    ("mach c", "mach d", -0.25, "KG", "PR", 3, "seq2"),            # Ω3 only (not bucketed)
    ("mach c", "mach d", 0.0, "KG", "PR", 4, "seq2"),              # zero gap: dropped
    ("mach d", "mach c", 0.3, "PR", "KG", 2, "seq2"),              # agreement 2 -> Ω3
]


def test_vhed_subsets_and_buckets(tmp_path):
    data = load_vhed(write_vhed(tmp_path / "v.csv", VHED_ROWS))
    pairs = vhed_pairs(data)
    assert [p.subsets for p in pairs] == [
        ("Ω4", "Ω{4,5}", "R&M", "|gap|≤0.1"),
        ("Ω5", "Ω{4,5}", "M&M", "0.1<|gap|≤0.2"),
        ("Ω5", "Ω{4,5}", "R&M", "|gap|>0.3"),
        ("Ω3",),
        ("Ω3",),
    ]
    assert [(p.better, p.worse) for p in pairs[:3]] == [("ref one", "mach a"), ("mach b", "mach a"),
                                                        ("ref one", "mach b")]
    assert pairs[0].references == ("ref one",)
    everywhere = vhed_pairs(data, bucket_agreements=(3, 4, 5), gap_edges=(0.25, 0.5, 1.0))
    assert everywhere[3].subsets == ("Ω3", "|gap|≤0.25") and everywhere[4].subsets == ("Ω3", "0.25<|gap|≤0.5")
    assert everywhere[0].subsets[-1] == "|gap|≤0.25"
    with pytest.raises(ValueError, match="increasing"):
        vhed_pairs(data, gap_edges=(0.2, 0.1))
    # a reference-vs-reference pair is in neither R&M nor M&M
    refs = load_vhed(write_vhed(tmp_path / "r.csv", [("ref one", "ref two", -0.5, "reference", "GT", 5, "q")]))
    assert vhed_pairs(refs)[0].subsets == ("Ω5", "Ω{4,5}", "|gap|>0.3")
    # accuracy on VHED's subsets, by hand: story length as the metric
    metric = Lookup({"ref one": 3, "mach a": 1, "mach b": 2, "mach c": 0, "mach d": 0})
    got = rows_of(pairs_table(pairs, [Metric("m", reward=metric)], progress=False))
    assert got[("Ω{4,5}", "m")][2:] == [3, 1.0] and got[("Ω3", "m")][2:] == [2, 0.0]
    assert got[("R&M", "m")][2:] == [2, 1.0] and got[("all", "m")][2:] == [5, 3 / 5]
    assert ("0.2<|gap|≤0.3", "m") not in got  # empty buckets have no row


class RefRecorder:
    """A fake reference-based metric: scores = number of references it got."""

    name = "refs"

    class args:
        reference_absent = True

    def __init__(self):
        self.got = {}

    def score(self, stories, references=None, **context):
        for s, r in zip(stories, references):
            self.got.setdefault(s, []).append(tuple(r))
        return np.array([float(len(r)) for r in references])


def test_reference_absent_drops_both_stories_of_the_pair():
    pairs = [PreferencePair("Ref  One", "mach", references=("ref one", "ref two", "ref three")),
             PreferencePair("mach", "other", references=("ref one", "ref two"))]
    rec = RefRecorder()
    pairs_table(pairs, [Metric("refs", reward=rec)], progress=False)
    assert rec.got["Ref  One"] == [("ref two", "ref three")]  # case/whitespace-insensitive identity
    assert sorted(rec.got["mach"]) == [("ref one", "ref two"), ("ref two", "ref three")]


def test_reference_absent_bleu_against_sacrebleu(tmp_path):
    sacrebleu = pytest.importorskip("sacrebleu")
    from storyrl.rewards import create_reward

    refs = ["the family went to the beach . they swam all day .",
            "we went to the beach . the water was cold .",
            "my family had a picnic at the park ."]
    pairs = [PreferencePair(refs[0], "the beach was nice . we swam .", references=tuple(refs)),
             PreferencePair("we went to the beach and swam .", refs[1], references=tuple(refs)),
             PreferencePair("the family had a picnic .", "a dog .", references=tuple(refs))]
    bleu = create_reward("bleu", reference_absent=True)
    result = pairs_table(pairs, [Metric("bleu", reward=bleu)], progress=False)

    def hand(story, pair):
        left = [r for r in refs if r not in (pair.better, pair.worse)]
        return max(sacrebleu.sentence_bleu(story, [r]).score for r in left)

    expected = np.mean([hand(p.better, p) > hand(p.worse, p) for p in pairs])
    assert rows_of(result)[("all", "bleu")][3] == pytest.approx(expected)
    # without the rule the reference story matches itself: always correct on R&M pair 1
    plain = pairs_table(pairs[:1], [Metric("bleu", reward=create_reward("bleu"))], progress=False)
    assert rows_of(plain)[("all", "bleu")][3] == 1.0


# -- correlations ---------------------------------------------------------------

def test_correlations_equal_scipy_and_bootstrap():
    rng = np.random.default_rng(1)
    human = rng.integers(1, 6, 30).astype(float)
    metric = human + rng.normal(0, 1.5, 30)
    got = correlations(human, metric)
    assert got["kendall"] == pytest.approx(stats.kendalltau(human, metric).statistic)
    assert got["spearman"] == pytest.approx(stats.spearmanr(human, metric).statistic)
    assert got["pearson"] == pytest.approx(stats.pearsonr(human, metric).statistic)
    a = bootstrap_ci(human, metric, n_boot=200, seed=3)
    assert a == bootstrap_ci(human, metric, n_boot=200, seed=3)
    assert a != bootstrap_ci(human, metric, n_boot=200, seed=4)
    assert a[0] < got["kendall"] < a[1]
    assert math.isnan(correlations([1, 1, 1], [1, 2, 3])["kendall"])
    assert system_means(["A", "B", "A", "A"], [1.0, 5.0, 2.0, 6.0]) == {"A": 3.0, "B": 5.0}


RATINGS = [
    # team, story_id, workerId, focused, coherent, system
    ("auto-gen", "s1", "w1", 5, 4, "A"), ("auto-gen", "s1", "w2", 4, 4, "A"),
    ("auto-gen", "s2", "w1", 2, 3, "A"), ("auto-gen", "s3", "w1", 3, 1, "B"),
    ("auto-gen", "s4", "w2", 1, 2, "B"), ("auto-gen", "s4", "w3", 2, 2, "B"),
    ("auto-gen", "s5", "w1", 4, 5, "C"), ("human", "s6", "w1", 5, 5, "H"),
]


def write_ratings(path):
    header = "team,story_id,album_id,workerId,focused,coherent,share,human,grounded,detailed,system,,,"
    lines = [header] + [f"{t},{s},99,{w},{f},{c},3,3,3,3,{sy},,," for t, s, w, f, c, sy in RATINGS]
    path.write_text("\n".join(lines) + "\n")
    return path


STORY_SCORES = {"s1": 0.9, "s2": 0.5, "s3": 0.6, "s4": 0.1, "s5": math.nan, "s6": 0.8}


class ByStory:
    name = "bystory"

    def score(self, stories, story_id=None, **context):
        return np.array([STORY_SCORES[s] for s in story_id])


def test_ratings_story_and_system_level_by_hand(tmp_path):
    ratings = load_ratings(write_ratings(tmp_path / "r.csv"), aspects=["focused", "coherent"],
                           system_column="system", where={"team": "auto-gen"})
    assert ratings.story_ids == ["s1", "s2", "s3", "s4", "s5"] and ratings.kept == 7
    records = {sid: type("R", (), {"story": f"story {sid}", "story_id": sid})() for sid in STORY_SCORES}
    for r in records.values():
        for key in ("images", "image_ids", "reference", "references", "noun_phrases"):
            setattr(r, key, None)
    result = ratings_table(ratings, records, [Metric("m", reward=ByStory())], n_boot=100, seed=0, progress=False)
    assert result.unscorable == {"m": 1}  # s5 NaN, dropped
    story = {r[2]: r for r in result.rows if r[0] == "story"}
    human = [4.5, 2.0, 3.0, 1.5]  # focused means of s1..s4
    metric = [0.9, 0.5, 0.6, 0.1]
    assert story["focused"][3] == 4
    assert story["focused"][4] == pytest.approx(stats.kendalltau(human, metric).statistic)
    assert story["focused"][5] == pytest.approx(stats.spearmanr(human, metric).statistic)
    assert story["focused"][6] == pytest.approx(stats.pearsonr(human, metric).statistic)
    system = {r[2]: r for r in result.rows if r[0] == "system"}
    # systems A (s1, s2) and B (s3, s4); C has no scored story
    hum = [(4.5 + 2.0) / 2, (3.0 + 1.5) / 2]
    met = [(0.9 + 0.5) / 2, (0.6 + 0.1) / 2]
    assert system["focused"][3] == 2
    assert system["focused"][4] == pytest.approx(stats.kendalltau(hum, met).statistic)
    assert math.isnan(system["focused"][7])
    # a system-level τ over 2 systems is ±1 by construction: warned (issue 21 item 5)
    assert len(result.notes) == 1 and "rest on 2 systems (fewer than 5)" in result.notes[0]


class _FakeRatings:
    """The parts of a ratings table :func:`ratings_table` reads."""

    def __init__(self, n_systems: int) -> None:
        self.story_ids = [f"s{k}" for k in range(2 * n_systems)]
        self.aspects = ["overall"]
        self.systems = {sid: f"sys{k // 2}" for k, sid in enumerate(self.story_ids)}

    def story_means(self, aspect):
        return {sid: float(k % 5) for k, sid in enumerate(self.story_ids)}


@pytest.mark.parametrize("n_systems, warned", [(2, True), (4, True), (5, False), (8, False)])
def test_system_level_over_few_systems_is_warned(n_systems, warned):
    from storyrl.eval.meta_eval import MIN_SYSTEMS

    ratings = _FakeRatings(n_systems)
    scores = {sid: float(k) for k, sid in enumerate(ratings.story_ids)}
    result = ratings_table(ratings, {sid: None for sid in ratings.story_ids}, [Metric("m", scores=scores)],
                           n_boot=10, progress=False)
    assert [r[3] for r in result.rows if r[0] == "system"] == [n_systems]
    assert bool(result.notes) == warned == (n_systems < MIN_SYSTEMS)
    if warned:
        assert result.notes == [f"warning: m: the system-level correlations rest on {n_systems} systems "
                                f"(fewer than {MIN_SYSTEMS}): not evidence of agreement; read the story-level rows"]


def test_original_vs_random_table():
    class Match:
        name = "match"

        def score(self, stories, images=None, **context):
            return np.array([1.0 if s == f"story {i[0]}" else 0.0 for s, i in zip(stories, images)])

    records = [type("R", (), dict(story=f"story {k}", story_id=str(k), images=[str(k)], image_ids=None,
                                  reference=None, references=None, noun_phrases=None))() for k in range(5)]
    result = original_vs_random_table(records, [Metric("match", reward=Match())], k=2)
    (row,) = result.rows
    assert row[:3] == ["match", 5, 2] and row[4] == 1.0  # delta_mean: original 1, random 0


# -- command line -------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_pairs_jsonl_end_to_end(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in [
        {"better": "we went to the park . we played ball .", "worse": "the park . the park . the park .",
         "subsets": ["a"], "better_id": "1", "worse_id": "2"},
        {"better": "the cat slept .", "worse": "a dog ran to the lake and swam .", "subset": "b",
         "better_id": "3", "worse_id": "4"},
    ]) + "\n")
    scores = tmp_path / "scores.csv"
    scores.write_text("story_id,col\n1,0.9\n2,0.1\n3,0.5\n4,0.5\n")
    out = tmp_path / "t.csv"
    res = run("meta-eval", "pairs", "--pairs", path, "-m", f"repetition,{scores}:col", "--out", out, "-q")
    assert res.exit_code == 0, res.output
    table = list(csv.reader(out.open()))
    assert table[0] == ["subset", "metric", "n", "accuracy"]
    got = {(r[0], r[1]): (int(r[2]), float(r[3])) for r in table[1:]}
    assert got[("all", "col")] == (2, 0.5) and got[("a", "col")] == (1, 1.0)
    assert got[("a", "repetition")] == (1, 1.0)
    assert out.with_suffix(".md").read_text().count("|") > 10
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    again = run("meta-eval", "pairs", "--pairs", path, "-m", "repetition", "--out", out, "-q")
    assert again.exit_code != 0 and "exists: use --overwrite" in again.output
    assert run("meta-eval", "pairs", "--pairs", path, "-m", "repetition", "--out", out, "-q",
               "--overwrite").exit_code == 0


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"better": "a", "worse": "b"}\n{"better": "", "worse": "b"}\n')
    res = run("meta-eval", "pairs", "--pairs", bad, "-m", "repetition", "--out", tmp_path / "o.csv")
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [f"Error: {bad}: line 2: 'better' must be a non-empty string"]
    res = run("meta-eval", "pairs", "--pairs", bad, "--vhed", bad, "-m", "repetition", "--out", tmp_path / "o.csv")
    assert res.exit_code == 1 and "exactly one of" in res.output
    res = run("meta-eval", "pairs", "--pairs", bad, "-m", "nosuch", "--out", tmp_path / "o.csv")
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.csv").exists()


def test_cli_every_metric_failed_exits_nonzero(tmp_path):
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"better": "a b", "worse": "c d", "better_id": "x", "worse_id": "y"}) + "\n")
    scores = tmp_path / "s.csv"
    scores.write_text("story_id,col\nx,\ny,\n")
    res = run("meta-eval", "pairs", "--pairs", pairs, "--scores", scores, "--out", tmp_path / "o.csv", "-q")
    assert res.exit_code == 1 and "every metric failed" in res.output
    assert not (tmp_path / "o.csv").exists()


def test_cli_vist_edit_and_vhed(tmp_path):
    root = tmp_path / "vist_edit"
    for model, split, machine, edits in [
        ("AREL", "dev", "the dog ran far . the dog ran far .", [["we went out .", "it was fun ."],
                                                               ["the dog ran far .", "the  dog ran far ."]]),
        ("GLAC", "test", "a day at the park . fun .", [["a day at the park .", "we had fun ."]]),
    ]:
        (root / model / split).mkdir(parents=True)
        (root / model / split / "1.json").write_text(json.dumps({
            "photo_sequence_id": "1", "photo_sequence_ids": ["1", "2"], "auto_story_text_normalized": machine,
            "edited_stories": [{"worker_id": "w", "normalized_edited_story_text_sent": e} for e in edits],
            "data_split": split, "model": model}))
    out = tmp_path / "ve.csv"
    res = run("meta-eval", "pairs", "--vist-edit", root, "-m", "repetition", "--out", out, "-q")
    assert res.exit_code == 0, res.output
    got = {r[0]: r for r in csv.reader(out.open())}
    # AREL: one real edit (correct), one identical edit (a tie: wrong)
    assert got["AREL-edit"][2:] == ["2", "0.5"] and got["GLAC-edit"][2] == "1"
    assert "1 edits identical" in out.with_suffix(".md").read_text()
    two = [(f"{a} . it was fun .", f"{b} . we left .", *rest) for a, b, *rest in VHED_ROWS]  # repetition: 2+ sentences
    vhed = write_vhed(tmp_path / "v.csv", two)
    out2 = tmp_path / "vh.csv"
    res = run("meta-eval", "pairs", "--vhed", vhed, "-m", "repetition", "--out", out2, "-q")
    assert res.exit_code == 0, res.output
    subsets = [r[0] for r in csv.reader(out2.open())][1:]
    assert subsets == ["all", "Ω3", "Ω4", "Ω5", "Ω{4,5}", "R&M", "M&M", "|gap|≤0.1", "0.1<|gap|≤0.2", "|gap|>0.3"]


def test_cli_ratings_end_to_end(tmp_path):
    ratings = write_ratings(tmp_path / "r.csv")
    stories = tmp_path / "s.json"
    stories.write_text(json.dumps({sid: f"we went to place {k} . it was fun {k} ." for k, sid in
                                   enumerate(STORY_SCORES)}))
    scores = tmp_path / "sc.csv"
    scores.write_text("story_id,m\n" + "".join(f"{s},{'' if math.isnan(v) else v}\n" for s, v in STORY_SCORES.items()))
    out = tmp_path / "t.csv"
    res = run("meta-eval", "ratings", ratings, "--stories", stories, "--where", "team=auto-gen", "--scores", scores,
              "-m", "repetition", "--system-column", "system", "--n-boot", "50", "--out", out, "-q")
    assert res.exit_code == 0, res.output
    table = list(csv.DictReader(out.open()))
    assert list(table[0]) == ["subset", "metric", "aspect", "n", "kendall", "spearman", "pearson", "ci_low", "ci_high"]
    row = next(r for r in table if r["subset"] == "story" and r["metric"] == "m" and r["aspect"] == "focused")
    assert row["n"] == "4" and float(row["kendall"]) == pytest.approx(
        stats.kendalltau([4.5, 2.0, 3.0, 1.5], [0.9, 0.5, 0.6, 0.1]).statistic)
    assert {r["subset"] for r in table} == {"story", "system"}
    assert out.with_suffix(".png").exists()
    # two systems: the warning is on stderr and in the printed/written table's notes
    assert "warning: m: the system-level correlations rest on 2 systems" in res.output
    assert "warning: m: the system-level correlations rest on 2 systems" in out.with_suffix(".md").read_text()
    res = run("meta-eval", "ratings", ratings, "--stories", stories, "--where", "team=nobody", "-m", "repetition",
              "--out", tmp_path / "x.csv")
    assert res.exit_code == 1 and "no rating rows matching team=nobody" in res.output


def test_cli_original_vs_random(tmp_path):
    stories = tmp_path / "s.jsonl"
    stories.write_text("".join(json.dumps({"story_id": str(k), "story": f"we saw {k} birds . they flew ."}) + "\n"
                               for k in range(4)))
    out = tmp_path / "o.csv"
    res = run("meta-eval", "original-vs-random", stories, "-m", "repetition", "-k", "2", "--out", out, "-q")
    assert res.exit_code == 0, res.output
    (row,) = list(csv.DictReader(out.open()))
    assert row["metric"] == "repetition" and row["n"] == "4" and row["k"] == "2"


def test_pairs_jsonl_loader(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"better": "a", "worse": "b", "subsets": ["x", "x"], "gap": 1, "reference": "r",'
                    ' "references": ["q"], "images": ["i"]}\n\n')
    (pair,) = load_pairs_jsonl(path)
    assert pair.subsets == ("x",) and pair.gap == 1.0 and pair.references == ("q", "r") and pair.images == ("i",)


def test_vhed_extra_references(tmp_path):
    vhed = write_vhed(tmp_path / "v.csv", VHED_ROWS)
    pairs = vhed_pairs(load_vhed(vhed), references={"seq1": ["extra", "ref one"], "t3": ["by story id"]})
    assert pairs[0].references == ("ref one", "extra") and pairs[3].references == ("by story id",)
    bad = tmp_path / "refs.json"
    bad.write_text("{oops")
    res = run("meta-eval", "pairs", "--vhed", vhed, "--references", bad, "-m", "repetition", "--out", tmp_path / "o.csv")
    assert res.exit_code == 1 and res.output.strip().splitlines() == [f"Error: {bad}: invalid JSON at line 1: "
                                                                      "Expecting property name enclosed in double quotes"]


class FirstWins:
    """A pairwise judge that always prefers the story it reads first."""

    name = "first"

    def __init__(self):
        self.firsts = []

    def compare(self, first, second, **context):
        self.firsts.extend(first)
        return np.ones(len(first))


def test_pairwise_judge_reads_pairs_in_source_order(tmp_path):
    # VHED: story1 first, as the model was trained; a first-story bias earns
    # exactly the share of pairs whose story1 is better (2 of the 5 kept rows).
    pairs = vhed_pairs(load_vhed(write_vhed(tmp_path / "v.csv", VHED_ROWS)))
    judge = FirstWins()
    assert rows_of(pairs_table(pairs, [Metric("first", reward=judge)], progress=False))[("all", "first")][2:] == [5, 2 / 5]
    assert judge.firsts == [r[0] for r in VHED_ROWS if r[2] != 0]
    # Pairs without an order: a fixed coin per pair, not always the better story first.
    loose = [PreferencePair(f"better {i}", f"worse {i}") for i in range(40)]
    judge = FirstWins()
    accuracy = rows_of(pairs_table(loose, [Metric("first", reward=judge)], progress=False))[("all", "first")][3]
    assert accuracy == sum(f.startswith("better") for f in judge.firsts) / 40 and 0.25 < accuracy < 0.75
    again = FirstWins()
    pairs_table(loose, [Metric("first", reward=again)], progress=False)
    assert again.firsts == judge.firsts  # reproducible
