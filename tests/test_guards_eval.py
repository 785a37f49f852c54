"""Guards for rewards, evaluation and generation code against realistic
bugs, each checked against a hand computation, scipy / rouge-score called
directly, or a plainly written reference: the dhm reward's human-score
cache and noun phrases, COSMiC's ``count_mismatch: min``, ROUGE-L's
``measure`` under ``reference_absent``, meta-eval's system-level
correlations and bootstrap interval, sweep cell completeness, ablation
scoring and table membership, the authors' post-processing and the
sampling options reaching ``generate``."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models

import storyrl  # noqa: F401  (torchvision fallback before open_clip / transformers)
from storyrl.rewards import create_reward

pytestmark = pytest.mark.usefixtures("one_thread_module")

HUMAN_A = "The dog ran to the park. The dog saw a red car. The sun was hot that day."
HUMAN_B = "We went to the beach. The sea was blue. The sea was blue and we ate cake."
MODEL = "The dog saw the car. The dog ran and ran to the park. The dog ran to the park."


# -- dhm reward -----------------------------------------------------------------------------------


def test_dhm_rescores_a_new_reference_of_the_same_story_id():
    """The human-score cache is keyed by (story id, reference text): another
    reference for the same id is scored, not answered from the cache."""
    repetition = create_reward("repetition")
    h_a, h_b, m = repetition.score([HUMAN_A, HUMAN_B, MODEL])
    assert len({h_a, h_b, m}) == 3  # the case is real: three different scores
    reward = create_reward("dhm", dimensions=["repetition"])
    first = reward.score([MODEL], story_id=["s0"], reference=[HUMAN_A])
    np.testing.assert_allclose(first, [-abs(h_a - m)], atol=1e-12)
    second = reward.score([MODEL], story_id=["s0"], reference=[HUMAN_B])
    np.testing.assert_allclose(second, [-abs(h_b - m)], atol=1e-12)
    assert reward.stats["human_scored"] == 2
    # both in one batch, and again from the cache
    for _ in range(2):
        both = reward.score([MODEL, MODEL, MODEL], story_id=["s0", "s0", "s1"], reference=[HUMAN_A, HUMAN_B, HUMAN_A])
        np.testing.assert_allclose(both, [-abs(h_a - m), -abs(h_b - m), -abs(h_a - m)], atol=1e-12)
    assert reward.stats["human_scored"] == 3  # (s1, A) was new
    np.testing.assert_allclose(reward.last_components["repetition/human"], [h_a, h_b, h_a], atol=1e-12)


NOUNS = ["dog", "park", "car", "sun", "beach", "sea", "cake"]


def test_dhm_grounding_parses_the_human_storys_own_noun_phrases(tiny_clip, images, tmp_path):
    """With ``noun_phrases`` given for the model stories only, the human
    story's noun phrases come from its own text, never the model's."""
    pronouns = tmp_path / "pronouns.txt"
    pronouns.write_text("it\nwe\n")
    grounding = {"clip_model": tiny_clip, "clip_pretrained": None, "theta": 0.5, "weighting": "none",
                 "pronouns": str(pronouns), "regions": "whole", "device": "cpu"}
    reward = create_reward("dhm", dimensions=["grounding"], rewards={"grounding": grounding})
    reward.component_rewards["grounding"]._extractor = tiny_models.KeywordPhrases(NOUNS)
    model_nps = [["a red car"], ["the blue sea"]]
    seqs = [images, images[::-1]]
    got = reward.score([MODEL, MODEL], story_id=["a", "b"], reference=[HUMAN_A, HUMAN_B], images=seqs,
                       noun_phrases=model_nps)
    groovist = create_reward("groovist", **grounding)
    groovist._extractor = tiny_models.KeywordPhrases(NOUNS)
    human = groovist.score([HUMAN_A, HUMAN_B], images=seqs,
                           noun_phrases=[[w for w in NOUNS if w in HUMAN_A.lower()],  # each one's own
                                         ["beach", "sea", "cake"]])
    parsed = groovist.score([HUMAN_A, HUMAN_B], images=seqs)  # the same by the extractor
    np.testing.assert_allclose(human, parsed, atol=1e-9)
    model = groovist.score([MODEL, MODEL], images=seqs, noun_phrases=model_nps)
    assert not np.allclose(human, model)  # the case is real
    np.testing.assert_allclose(got, -np.abs(np.tanh(human) - np.tanh(model)), atol=1e-6)
    np.testing.assert_allclose(reward.last_components["grounding/human"], human, atol=1e-6)
    # given as reference_noun_phrases, the human side uses those
    given = create_reward("dhm", dimensions=["grounding"], rewards={"grounding": grounding})
    given.component_rewards["grounding"]._extractor = None  # would parse (spaCy): must not be needed
    human_nps = [["the park", "a red car"], ["the beach"]]
    got = given.score([MODEL, MODEL], story_id=["a", "b"], reference=[HUMAN_A, HUMAN_B], images=seqs,
                      noun_phrases=model_nps, reference_noun_phrases=human_nps)
    human = groovist.score(["x", "y"], images=seqs, noun_phrases=human_nps)
    np.testing.assert_allclose(got, -np.abs(np.tanh(human) - np.tanh(model)), atol=1e-6)


# -- COSMiC count_mismatch: min --------------------------------------------------------------------


class FakeCosmicScorer:
    """Stands in for a trained COSMiC: a pair's score is a plain function of
    its texts, so a story's mean can be computed by hand."""

    def __init__(self) -> None:
        self.head = SimpleNamespace(config=SimpleNamespace(use_image=False), label_index=lambda label: 0)
        self.seen = []

    def score(self, examples):
        self.seen.extend(examples)
        return np.array([len(e.candidate) + 0.01 * len(e.reference) for e in examples], dtype=np.float64)


def test_cosmic_min_pairs_up_to_the_shortest_of_story_reference_and_images(images, tmp_path, monkeypatch):
    import storyrl.models.cosmic

    fake = FakeCosmicScorer()
    monkeypatch.setattr(storyrl.models.cosmic, "load_cosmic", lambda *a, **k: fake)
    lenient = create_reward("cosmic", model=str(tmp_path), count_mismatch="min", device="cpu")
    strict = create_reward("cosmic", model=str(tmp_path), device="cpu")
    story = "A dog ran. A boat sailed far. I love it."  # 3 sentences, 3 images
    short_ref = "A dog on a road. A boat at sea."  # 2 sentences
    got = lenient.score([story, "One thing."], images=[images, images], reference=[short_ref, short_ref])
    pairs = [("A dog ran.", "A dog on a road."), ("A boat sailed far.", "A boat at sea.")]
    want0 = np.mean([len(c) + 0.01 * len(r) for c, r in pairs])
    want1 = len("One thing.") + 0.01 * len("A dog on a road.")  # 1 sentence: one pair
    np.testing.assert_allclose(got, [want0, want1], atol=1e-12)
    assert [(e.image, e.candidate, e.reference) for e in fake.seen[:2]] == [
        (images[0], *pairs[0]), (images[1], *pairs[1])]
    # a reference given as a list of sentences, and fewer images than both
    got = lenient.score([story], images=[images[:1]], reference=[["Ref one.", "Ref two.", "Ref three."]])
    np.testing.assert_allclose(got, [len("A dog ran.") + 0.01 * len("Ref one.")], atol=1e-12)
    # without min: unscorable
    assert math.isnan(strict.score([story], images=[images], reference=[short_ref])[0])
    assert strict.stats["reasons"]["count mismatch"] == 1


# -- ROUGE-L measure -------------------------------------------------------------------------------

STORY = "the dog ran to the park and saw a big red car near the gate ."
REFS = ["a dog ran to a park .", "the dog saw a red car near the gate and barked at it loudly for a long time .",
        "we ate cake ."]


@pytest.mark.parametrize("measure", ["fmeasure", "precision", "recall"])
def test_rouge_l_measure_with_and_without_reference_absent(measure):
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(["rougeL"], use_stemmer=False)
    one = {r: getattr(scorer.score(r, STORY)["rougeL"], measure) for r in REFS}
    assert len(set(one.values())) == 3
    # reference-absent: the story itself dropped, the max of the measure over the others one at a time
    absent = create_reward("rouge_l", measure=measure, reference_absent=True)
    got = absent.score([STORY], references=[[STORY.upper(), *REFS]])[0]
    assert got == pytest.approx(max(one.values()), abs=1e-12)
    assert absent.score([STORY], reference=[REFS[0]])[0] == pytest.approx(one[REFS[0]], abs=1e-12)
    # all references at once: rouge-score's score_multi (reference chosen by F-measure)
    plain = create_reward("rouge_l", measure=measure)
    multi = getattr(scorer.score_multi(REFS, STORY)["rougeL"], measure)
    assert plain.score([STORY], references=[REFS])[0] == pytest.approx(multi, abs=1e-12)


def test_rouge_l_measures_differ_so_the_option_matters():
    from rouge_score.rouge_scorer import RougeScorer

    s = RougeScorer(["rougeL"]).score(REFS[1], STORY)["rougeL"]
    assert len({s.fmeasure, s.precision, s.recall}) == 3
    got = {m: create_reward("rouge_l", measure=m, reference_absent=True).score([STORY], reference=[REFS[1]])[0]
           for m in ("fmeasure", "precision", "recall")}
    assert got == pytest.approx({"fmeasure": s.fmeasure, "precision": s.precision, "recall": s.recall}, abs=1e-12)


# -- meta-eval ------------------------------------------------------------------------------------

# story, system, rating, score: systems interleaved, a NaN score in the middle (b1)
RATED = [("a1", "A", 5, 0.9), ("b1", "B", 1, math.nan), ("c1", "C", 3, 0.5), ("d1", "D", 2, 0.4),
         ("a2", "A", 4, 0.7), ("b2", "B", 2, 0.1), ("c2", "C", 4, 0.8), ("d2", "D", 1, 0.2),
         ("e1", "E", 3, 0.3), ("e2", "E", 5, 0.6)]


def _ratings(tmp_path):
    from storyrl.judgements.ratings import load_ratings

    path = tmp_path / "ratings.csv"
    path.write_text("story_id,workerId,focused,system\n" + "".join(f"{s},w1,{r},{y}\n" for s, y, r, _ in RATED))
    ratings = load_ratings(path, aspects=["focused"], system_column="system")
    records = {s: SimpleNamespace(story=f"story {s}", story_id=s, images=None, image_ids=None, reference=None,
                                  references=None, noun_phrases=None) for s, *_ in RATED}
    return ratings, records


def _plain_bootstrap(x, y, n_boot, seed, level):
    """Percentile bootstrap of Kendall τ-b written out: default_rng(seed),
    n indices drawn per resample, degenerate resamples skipped."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    taus = []
    for _ in range(n_boot):
        pick = rng.integers(0, len(x), len(x))
        xs, ys = x[pick], y[pick]
        if len(set(xs)) > 1 and len(set(ys)) > 1:
            taus.append(stats.kendalltau(xs, ys).statistic)
    half = (100 - 100 * level) / 2
    return np.percentile(taus, [half, 100 - half])


def test_system_level_correlation_after_a_nan_story_by_hand(tmp_path):
    from scipy import stats

    from storyrl.eval.meta_eval import Metric, ratings_table

    ratings, records = _ratings(tmp_path)
    scores = {s: v for s, _, _, v in RATED}
    result = ratings_table(ratings, records, [Metric("m", scores=scores)], n_boot=200, seed=5, progress=False)
    assert result.unscorable == {"m": 1}
    rows = {r[0]: r for r in result.rows}
    # by hand, b1 dropped: A (5, 4 | .9, .7), B (2 | .1), C (3, 4 | .5, .8), D (2, 1 | .4, .2), E (3, 5 | .3, .6)
    human = [4.5, 2.0, 3.5, 1.5, 4.0]
    metric = [0.8, 0.1, 0.65, 0.3, 0.45]
    system = rows["system"]
    assert system[3] == 5
    assert system[4] == pytest.approx(stats.kendalltau(human, metric).statistic)
    assert system[5] == pytest.approx(stats.spearmanr(human, metric).statistic)
    assert system[6] == pytest.approx(stats.pearsonr(human, metric).statistic)
    # story level: the 9 scored stories
    kept = [(r, v) for _, _, r, v in RATED if not math.isnan(v)]
    h, m = np.array([r for r, _ in kept], float), np.array([v for _, v in kept])
    story = rows["story"]
    assert story[3] == 9 and story[4] == pytest.approx(stats.kendalltau(h, m).statistic)
    # its 95% interval: the plain percentile bootstrap with the same seed
    assert story[7:9] == pytest.approx(list(_plain_bootstrap(h, m, 200, 5, 0.95)), abs=1e-12)


def test_bootstrap_ci_level_is_the_central_interval():
    from storyrl.eval.meta_eval_stats import bootstrap_ci

    rng = np.random.default_rng(2)
    x = rng.integers(1, 6, 25).astype(float)
    y = x + rng.normal(0, 2.0, 25)
    for level in (0.95, 0.9, 0.5):
        want = _plain_bootstrap(x, y, 300, 11, level)
        assert bootstrap_ci(x, y, n_boot=300, seed=11, level=level) == pytest.approx(tuple(want), abs=1e-12)
    wide, narrow = bootstrap_ci(x, y, n_boot=300, seed=11), bootstrap_ci(x, y, n_boot=300, seed=11, level=0.9)
    assert wide[0] < narrow[0] and narrow[1] < wide[1]  # the default is 95%, wider than 90%


# -- sweep: when is a cell complete ---------------------------------------------------------------


def _prompting_cell(root: Path):
    from storyrl.eval.sweep import Cell

    return Cell("m", "visual", "P1", "prompting", {"model": "some/vlm", "setting": "visual", "prompt": "P1"},
                root / "cells" / "m" / "visual" / "P1")


def _write_cell(cell, stories: dict, failures: dict, complete: bool) -> None:
    from storyrl.eval.sweep import _generator_config
    from storyrl.generators.runs import sidecar_path

    cell.directory.mkdir(parents=True, exist_ok=True)
    cell.stories.write_text(json.dumps(stories))
    meta = {"generator": "prompting", "options": _generator_config(cell).to_dict(), "complete": complete,
            "failures": failures}
    sidecar_path(cell.stories).write_text(json.dumps(meta))


@pytest.mark.parametrize(("stories", "failures", "complete", "done"), [
    ({"s0": "x"}, {}, True, False),  # covers one record of three
    ({"s0": "x", "s2": "z"}, {}, True, False),
    ({"s0": "x", "s2": "z"}, {"s1": "an error"}, True, True),  # a failure counts as done
    ({"s0": "x", "s1": "y", "s2": "z"}, {}, True, True),
    ({"s0": "x", "s1": "y", "s2": "z"}, {}, False, False),  # interrupted before the sidecar said complete
    ({"s0": "x", "s1": "y", "s2": "z", "s9": "w"}, {}, True, True),
], ids=["one", "two", "failure", "all", "not-complete", "extra"])
def test_sweep_cell_is_complete_only_when_it_covers_every_record(tmp_path, stories, failures, complete, done):
    from storyrl.eval.sweep import _generated

    cell = _prompting_cell(tmp_path)
    assert _generated(cell, ["s0", "s1", "s2"]) is False  # nothing on disk
    _write_cell(cell, stories, failures, complete)
    assert _generated(cell, ["s0", "s1", "s2"]) is done


def test_sweep_regenerates_a_cell_that_covers_one_record(tmp_path, monkeypatch):
    import storyrl.generators
    import storyrl.generators.runs
    from storyrl.data import StoryRecord
    from storyrl.eval.sweep import _generate_cells
    from storyrl.eval.sweep_shards import Processes

    records = [StoryRecord(f"s{k}", "a story .") for k in range(3)]
    partial, full = _prompting_cell(tmp_path / "p"), _prompting_cell(tmp_path / "f")
    _write_cell(partial, {"s1": "y"}, {}, True)
    _write_cell(full, {"s0": "x", "s1": "y", "s2": "z"}, {}, True)
    generated = []
    monkeypatch.setattr(storyrl.generators, "create_generator", lambda name, **options: name)
    monkeypatch.setattr(storyrl.generators.runs, "generate_to_file",
                        lambda generator, recs, out, **kw: generated.append((Path(out), [r.story_id for r in recs])))
    _generate_cells([partial, full], records, Processes(), False, {})
    assert generated == [(partial.stories, ["s0", "s1", "s2"])]  # resumed by generate_to_file; full untouched


# -- ablation ------------------------------------------------------------------------------------

ABL_HUMAN = {
    "s0": "The dog ran to the park. It saw a red car. The sun was hot that day.",
    "s1": "We ate cake at home. The cake was big and sweet. Then we went to sleep.",
    "s2": "They walked by the tree. The sky was blue. A cat sat on the wall.",
}
#: s1's human story is its reference (its story field is a draft)
ABL_REFERENCE_S1 = "We baked a cake. It was big and sweet. We ate it all at home."
ABL_STORIES = {"s0": "The dog ran to the car. The sun was hot. The dog sat.",
               "s1": "We ate cake. The cake was big. We went to sleep.",
               "s2": "A cat sat on the wall. The sky was blue. The tree was big."}


def _ablation_data(root: Path) -> Path:
    rows = [{"story_id": sid, "story": text} for sid, text in ABL_HUMAN.items()]
    rows[1]["reference"] = ABL_REFERENCE_S1
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def _run_ablation(config: dict, root: Path, only=None):
    import yaml

    from storyrl.eval.ablation import AblationConfig, run_ablation

    path = root / "ablation.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return run_ablation(AblationConfig.from_yaml(path), progress=False, only=only)


def test_ablation_scores_each_story_against_the_human_story(tmp_path):
    """Reference-based metrics see the human story (the record's reference,
    else its story), so a record without a reference is still scored."""
    from rouge_score.rouge_scorer import RougeScorer

    stories = tmp_path / "v.json"
    stories.write_text(json.dumps(ABL_STORIES))
    config = {"output_dir": str(tmp_path / "out"), "stories": {"v": str(stories)},
              "eval": {"data": str(_ablation_data(tmp_path)), "metrics": ["repetition", "rouge_l"]}}
    result = _run_ablation(config, tmp_path)
    human = {**ABL_HUMAN, "s1": ABL_REFERENCE_S1}
    scorer = RougeScorer(["rougeL"])
    rouge = [scorer.score(human[s], ABL_STORIES[s])["rougeL"].fmeasure for s in ABL_STORIES]
    row = result.row("v")
    assert row.means["rouge_l"] == pytest.approx(float(np.mean(rouge)), rel=1e-12)
    repetition = create_reward("repetition")
    h = repetition.score([human[s] for s in ABL_STORIES])
    m = repetition.score(list(ABL_STORIES.values()))
    assert row.distances == pytest.approx({"repetition": float(np.mean(np.abs(h - m)))}, rel=1e-9)
    assert result.human.means["repetition"] == pytest.approx(float(np.mean(h)), rel=1e-12)


def test_ablation_only_run_leaves_out_an_unfinished_variant(tmp_path, monkeypatch):
    """``--only a``: variant b, not chosen, ran earlier but its stories are
    incomplete (interrupted, or covering one record): not in the table.
    Training and generation are replaced by fakes writing what they would."""
    import storyrl.eval.ablation as ablation
    from storyrl.generators.runs import sidecar_path

    def fake_train(variant, state, progress):
        (variant.train_dir / "final").mkdir(parents=True, exist_ok=True)
        return None

    def fake_generate(variant, rl_config, records, config, progress, inputs):
        variant.stories.write_text(json.dumps({r.story_id: ABL_STORIES[r.story_id] for r in records}))
        sidecar_path(variant.stories).write_text(json.dumps({"complete": True, "failures": {}}))

    monkeypatch.setattr(ablation, "_train", fake_train)
    monkeypatch.setattr(ablation, "_generate", fake_generate)
    base = {"model": "tiny", "policy": "causal_lm", "data": str(_ablation_data(tmp_path)), "rewards": ["repetition"],
            "max_steps": 2}
    config = {"output_dir": str(tmp_path / "out"), "train": base, "variants": {"a": {}, "b": {"reward_weights": [2.0]}},
              "eval": {"data": str(_ablation_data(tmp_path)), "metrics": ["repetition"]}}
    variants = {v.name: v for v in ablation.plan_variants(ablation.AblationConfig.from_mapping(config))}
    b = variants["b"]
    b.directory.mkdir(parents=True)
    b.state.write_text(json.dumps({"definition": b.definition, "trained": True}))
    for stories, complete in (({"s0": "x"}, True), (ABL_STORIES, False)):
        b.stories.write_text(json.dumps(stories))
        sidecar_path(b.stories).write_text(json.dumps({"complete": complete, "failures": {}}))
        assert ablation._finished_earlier(b, list(ABL_HUMAN), False) is False
        result = _run_ablation(config, tmp_path, only=["a"])
        assert [v.variant for v in result.variants] == ["a"]
    # once b's stories are complete it joins the table (as a finished variant should)
    sidecar_path(b.stories).write_text(json.dumps({"complete": True, "failures": {}}))
    assert ablation._finished_earlier(b, list(ABL_HUMAN), False) is True
    assert [v.variant for v in _run_ablation(config, tmp_path, only=["a"]).variants] == ["a", "b"]


# -- generation -----------------------------------------------------------------------------------


def test_clean_generation_cuts_after_the_last_inst_marker():
    from storyrl.generators.postprocess import clean_generation

    decoded = ('[INST] \nAdd one sentence to the following story: "It began. [/INST] A sentence." [/INST] '
               "The dog ran.\n\nIt was caf\u00e9 time.")
    assert clean_generation(decoded) == "The dog ran. It was cafe time."
    assert clean_generation("[INST] x [/INST] one [/INST] two [/INST]  three ") == "three"


class FakeEngine:
    """A generation engine that answers with the prompt (as the authors'
    decoding keeps it) followed by a reply that itself holds a marker."""

    family, text_model_type, commit, processor = "llava_next", "mistral", None, None

    def __init__(self) -> None:
        self.calls = []

    def generate(self, prompts, images, decode_prompt=False):
        self.calls.append((list(prompts), decode_prompt))
        reply = " Story time. [/INST] The dog ran. The cat sat. The sun set."
        return [(p.replace("<image>", "") if decode_prompt else "") + reply for p in prompts]


def test_prompting_generator_keeps_the_text_after_the_last_marker(images):
    from storyrl.data import StoryRecord
    from storyrl.generators import create_generator

    gen = create_generator("prompting", model="some/vlm", setting="visual", prompt="P1", sequence_image_size="8x8")
    gen._engine = FakeEngine()
    out = gen.generate([StoryRecord("s0", "a human story .", images=images)])
    assert gen._engine.calls[0][1] is True and "[/INST]" in gen._engine.calls[0][0][0]  # the authors' format
    assert out.stories == {"s0": "The dog ran. The cat sat. The sun set."}


class FakeVlm:
    """What TransformersEngine uses of storyrl.models.vlm.load_vlm's result;
    ``generate`` records its keyword arguments."""

    family, language_model_type, commit, device = "llava_next", "mistral", None, "cpu"

    def __init__(self) -> None:
        import torch
        from transformers import BatchEncoding

        self.seen = []
        self.processor = lambda images, text, return_tensors, padding: BatchEncoding(
            {"input_ids": torch.ones(len(text), 3, dtype=torch.long)})
        self.tokenizer = SimpleNamespace(pad_token_id=0, batch_decode=lambda out, skip_special_tokens: ["x"] * len(out))
        self.model = SimpleNamespace(generate=self._generate, dtype=torch.float32)

    def _generate(self, **kwargs):
        import torch

        self.seen.append(kwargs)
        return torch.ones(kwargs["input_ids"].shape[0], 5, dtype=torch.long)


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_sampling_options_reach_generate(monkeypatch, backend):
    import sys

    import transformers

    import storyrl.models.vlm
    from storyrl.generators import create_generator

    vlm, params = FakeVlm(), []
    monkeypatch.setattr(storyrl.models.vlm, "load_vlm", lambda *a, **k: vlm)
    # vLLM is faked too: nothing is downloaded, so the offline hub check must not stop it
    monkeypatch.setattr("storyrl.models.hub.require_hub_model", lambda *a, **k: None)

    class LLM:
        def __init__(self, **options):
            pass

        def generate(self, requests, sampling, use_tqdm=False):
            params.append(sampling)
            return [SimpleNamespace(outputs=[SimpleNamespace(text="x")]) for _ in requests]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=SimpleNamespace))
    config = SimpleNamespace(model_type="llava_next", text_config=None, _commit_hash=None)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: config)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: None)

    def sent(**options):
        gen = create_generator("prompting", model="some/vlm", backend=backend, chat_format="plain", **options)
        gen.setup()
        gen._engine.generate(["a prompt"], [None])
        if backend == "transformers":
            return {k: vlm.seen[-1][k] for k in ("do_sample", "top_k", "top_p", "temperature", "max_new_tokens")}
        p = params[-1]
        return {"top_k": p.top_k, "top_p": p.top_p, "temperature": p.temperature, "max_new_tokens": p.max_tokens}

    got = sent(do_sample=True, top_k=7, top_p=0.8, temperature=0.6, max_new_tokens=9)
    assert got == {**({"do_sample": True} if backend == "transformers" else {}), "top_k": 7, "top_p": 0.8,
                   "temperature": 0.6, "max_new_tokens": 9}
    greedy = sent(top_k=7)  # greedy: sampling values neutral
    assert greedy["top_k"] == (None if backend == "transformers" else -1)
    if backend == "vllm":
        assert sent(do_sample=True, top_k=0)["top_k"] == -1  # 0 = off, vLLM's -1


def test_meta_eval_ratings_command_defaults_to_a_95_percent_interval(tmp_path):
    from click.testing import CliRunner
    from scipy import stats

    from storyrl.cli import main

    ratings, _ = _ratings(tmp_path)
    stories = tmp_path / "stories.json"
    stories.write_text(json.dumps({s: f"we went to place {k} . it was fun ." for k, (s, *_) in enumerate(RATED)}))
    scores = tmp_path / "scores.csv"
    scores.write_text("story_id,m\n" + "".join(f"{s},{'' if math.isnan(v) else v}\n" for s, _, _, v in RATED))
    out = tmp_path / "table.csv"
    res = CliRunner().invoke(main, ["meta-eval", "ratings", str(ratings.path), "--stories", str(stories), "--scores",
                                    str(scores), "--aspects", "focused", "--system-column", "system", "--n-boot",
                                    "150", "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    rows = {r["subset"]: r for r in csv.DictReader(out.open())}
    kept = [(r, v) for _, _, r, v in RATED if not math.isnan(v)]
    h, m = np.array([r for r, _ in kept], float), np.array([v for _, v in kept])
    want = _plain_bootstrap(h, m, 150, 0, 0.95)  # seed 0 and level 0.95: the command's defaults
    assert [float(rows["story"]["ci_low"]), float(rows["story"]["ci_high"])] == pytest.approx(list(want), abs=1e-9)
    assert float(rows["system"]["kendall"]) == pytest.approx(
        stats.kendalltau([4.5, 2.0, 3.5, 1.5, 4.0], [0.8, 0.1, 0.65, 0.3, 0.45]).statistic)
