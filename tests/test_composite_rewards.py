"""Composite rewards (issue 11 part 1): ``dhm`` against an independent numpy
computation from the component rewards' own scores (tiny random CLIP and
RoViST-C models, the model-free repetition), human-score caching and tables,
NaN/None handling, failing components, logging; ``weighted`` with every
normalisation against numpy; configs, pickling and option errors."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from tiny_models import KeywordPhrases, albert_tokenizer, save_coherence_model

import storyrl  # noqa: F401  (torchvision fallback before open_clip / transformers)
from storyrl.rewards import create_reward, load_reward_config
from storyrl.rewards.base import RewardError

REPO = Path(__file__).resolve().parents[1]
NOUNS = ["dog", "cat", "park", "ball", "sun", "sea", "beach", "car", "tree", "cake", "sky"]

HUMAN = {
    "s0": "The dog ran to the park. It saw a red car. The sun was hot that day.",
    "s1": "We went to the beach. The sea was blue. We ate cake on the sand.",
    "s2": "A cat sat under the tree. The sky was grey. The cat went home.",
}
# Two completions per story, as a GRPO batch with num_generations=2.
IDS = ["s0", "s0", "s1", "s1", "s2", "s2"]
MODEL = [
    "The dog saw the car. The dog ran and ran to the park.",
    "A dog and a ball. The ball was red. The dog was happy.",
    "The sea was blue and the sun was hot. We ate cake.",
    "We went to the beach. We went to the beach again.",
    "The cat sat in the tree. The sky was blue. It was a good day.",
    "A cat. A cat. A tree and the sky and the cat.",
]
TEXTS = [*HUMAN.values(), *MODEL, "one sentence only . another"]


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_clip, images):
    root = tmp_path_factory.mktemp("composite")
    pronouns = root / "pronouns.txt"
    pronouns.write_text("it\nwe\nthey\nhe\nshe\n")
    coherence = save_coherence_model(root / "coherence", albert_tokenizer(TEXTS), seed=0, size="tiny", head_scale=20)
    sequences = {sid: images[k:] + images[:k] for k, sid in enumerate(HUMAN)}
    return {
        "root": root,
        "grounding": {"clip_model": tiny_clip, "clip_pretrained": None, "theta": 0.5, "weighting": "none",
                      "pronouns": str(pronouns), "regions": "whole", "device": "cpu"},
        "coherence": {"model": coherence, "device": "cpu"},
        "sequences": sequences,
    }


def dhm_reward(assets, **options):
    """A dhm reward on the tiny models; grounding reads nouns from the text."""
    options.setdefault("rewards", {"grounding": assets["grounding"], "coherence": assets["coherence"]})
    reward = create_reward("dhm", **options)
    if "grounding" in reward.component_rewards:
        reward.component_rewards["grounding"]._extractor = KeywordPhrases(NOUNS)
    return reward


def context(assets, ids=IDS, reference=True):
    out = {"story_id": list(ids), "images": [assets["sequences"][sid] for sid in ids]}
    if reference:
        out["reference"] = [HUMAN[sid] for sid in ids]
    return out


@pytest.fixture(scope="module")
def independent(assets):
    """Per dimension, the human and the model scores from separately built
    component rewards (their own .score), and the distances by hand."""
    groovist = create_reward("groovist", **assets["grounding"])
    groovist._extractor = KeywordPhrases(NOUNS)
    components = {"grounding": groovist, "coherence": create_reward("coherence", **assets["coherence"]),
                  "repetition": create_reward("repetition")}
    images = [assets["sequences"][sid] for sid in IDS]
    human = {d: r.score([HUMAN[sid] for sid in IDS], images=images) for d, r in components.items()}
    model = {d: r.score(MODEL, images=images) for d, r in components.items()}
    distance = {
        "grounding": np.abs(np.tanh(human["grounding"]) - np.tanh(model["grounding"])),
        "coherence": np.abs(human["coherence"] - model["coherence"]),
        "repetition": np.abs(human["repetition"] - model["repetition"]),
    }
    for values in (*human.values(), *model.values()):
        assert np.isfinite(values).all() and np.ptp(values) > 0  # meaningful: finite and not constant
    return {"human": human, "model": model, "distance": distance}


# -- dhm -----------------------------------------------------------------------------------


def test_dhm_equals_independent_computation(assets, independent):
    reward = dhm_reward(assets)
    got = reward.score(MODEL, **context(assets))
    d = independent["distance"]
    want = -np.mean([d["grounding"], d["coherence"], d["repetition"]], axis=0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # What is kept for a trainer's own logs: the raw model / human scores and the distances.
    for dim in ("grounding", "coherence", "repetition"):
        np.testing.assert_allclose(reward.last_components[dim], independent["model"][dim], atol=1e-6)
        np.testing.assert_allclose(reward.last_components[f"{dim}/human"], independent["human"][dim], atol=1e-6)
        np.testing.assert_allclose(reward.last_components[f"{dim}/distance"], d[dim], atol=1e-6)
    assert reward.stats["scored"] == len(MODEL) and reward.stats["unscorable"] == 0


@pytest.mark.parametrize(
    ("options", "dims", "weights", "sign"),
    [
        ({"dimensions": ["coherence", "repetition"]}, ["coherence", "repetition"], [1, 1], -1),
        ({"dimensions": ["grounding"]}, ["grounding"], [1], -1),
        ({"weights": {"grounding": 2.0, "repetition": 0.5}}, ["grounding", "coherence", "repetition"], [2, 1, 0.5], -1),
        ({"dimensions": ["repetition", "coherence"], "weights": {"coherence": 3}, "sign": 1},
         ["repetition", "coherence"], [1, 3], 1),
    ],
    ids=["no-grounding", "grounding-only", "weights", "sign+1"],
)
def test_dhm_dimensions_weights_and_sign(assets, independent, options, dims, weights, sign):
    reward = dhm_reward(assets, **options)
    assert list(reward.component_rewards) == dims  # only the selected dimensions' rewards exist
    got = reward.score(MODEL, **context(assets))
    d = np.array([independent["distance"][k] for k in dims])
    w = np.array(weights, dtype=float)
    np.testing.assert_allclose(got, sign * (w @ d) / w.sum(), rtol=0, atol=1e-6)
    assert reward.higher_is_better == (sign < 0)


def test_grounding_uses_each_sides_own_noun_phrases(assets):
    """``noun_phrases`` belong to the scored (model) stories, the human
    story's come as ``reference_noun_phrases``; neither side parses."""

    class NoParsing:
        def extract(self, stories):
            raise AssertionError("the noun phrases were given")

    reward = create_reward("dhm", dimensions=["grounding"], rewards={"grounding": assets["grounding"]})
    reward.component_rewards["grounding"]._extractor = NoParsing()
    ids = ["s0", "s1"]
    model_nps, human_nps = [["a dog", "the ball"], ["the sea"]], [["the park", "a red car"], ["the beach", "cake"]]
    got = reward.score(MODEL[:2], noun_phrases=model_nps, reference_noun_phrases=human_nps, **context(assets, ids))
    groovist = create_reward("groovist", **assets["grounding"])
    images = context(assets, ids)["images"]
    human = groovist.score(["x", "y"], images=images, noun_phrases=human_nps)
    model = groovist.score(["x", "y"], images=images, noun_phrases=model_nps)
    np.testing.assert_allclose(got, -np.abs(np.tanh(human) - np.tanh(model)), atol=1e-6)


def spy(monkeypatch, component):
    """Record the stories each ``score`` call of a component gets."""
    calls = []
    original = component.score

    def recording(stories, **context):
        calls.append(list(stories))
        return original(stories, **context)

    monkeypatch.setattr(component, "score", recording)
    return calls


def test_human_story_scored_once_per_story(assets, monkeypatch):
    reward = dhm_reward(assets, dimensions=["coherence", "repetition"])
    calls = {dim: spy(monkeypatch, r) for dim, r in reward.component_rewards.items()}
    first = reward.score(MODEL, **context(assets))
    again = reward.score(MODEL[::-1], **context(assets, IDS[::-1]))
    np.testing.assert_allclose(again, first[::-1], atol=1e-9)
    for dim, seen in calls.items():
        humans = [s for call in seen for s in call if s in HUMAN.values()]
        assert sorted(humans) == sorted(HUMAN.values()), dim  # each reference once, over both calls
        assert len(seen) == 3  # references (first call), model stories twice: one batched call each
    assert reward.stats["human_scored"] == 3
    # Without story ids the reference text is the key.
    by_text = dhm_reward(assets, dimensions=["coherence", "repetition"])
    seen = spy(monkeypatch, by_text.component_rewards["repetition"])
    ctx = context(assets)
    del ctx["story_id"]
    np.testing.assert_allclose(by_text.score(MODEL, **ctx), first, atol=1e-9)
    np.testing.assert_allclose(by_text.score(MODEL, **ctx), first, atol=1e-9)
    assert [s for call in seen for s in call if s in HUMAN.values()] == list(HUMAN.values())


def write_table(path: Path, rows: dict[str, tuple], columns=("groovist", "coherence", "repetition")) -> str:
    lines = ["story_id," + ",".join(columns)] + [f"{sid}," + ",".join(map(str, v)) for sid, v in rows.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_human_scores_from_a_table(assets, independent, tmp_path, monkeypatch):
    table = write_table(tmp_path / "human.csv", {"s0": (0.9, 0.25, 0.75), "s1": (-0.3, 0.5, "nan")})
    reward = dhm_reward(assets, human_scores=table)
    calls = [call for r in reward.component_rewards.values() for call in [spy(monkeypatch, r)]]
    ids = ["s0", "s1", "s2", "s9"]
    texts = [MODEL[0], MODEL[2], MODEL[4], MODEL[5]]
    ctx = {"story_id": ids, "images": [assets["sequences"][s] for s in ("s0", "s1", "s2", "s2")],
           "reference": [None, None, HUMAN["s2"], None]}
    got = reward.score(texts, **ctx)
    m = independent["model"]
    want0 = -np.mean([abs(np.tanh(0.9) - np.tanh(m["grounding"][0])), abs(0.25 - m["coherence"][0]),
                      abs(0.75 - m["repetition"][0])])
    assert got[0] == pytest.approx(want0, abs=1e-6)
    assert math.isnan(got[1])  # the table's repetition of s1 is NaN
    assert got[2] == pytest.approx(-np.mean([independent["distance"][d][4] for d in independent["distance"]]),
                                   abs=1e-6)  # not in the table: scored from its reference
    assert math.isnan(got[3])  # neither a row nor a reference
    scored = [s for seen in calls for call in seen for s in call]
    assert HUMAN["s2"] in scored and HUMAN["s0"] not in scored and HUMAN["s1"] not in scored
    reasons = reward.stats["reasons"]
    assert reasons["repetition: human story unscorable"] == 1 and reasons["no human story"] == 1
    missing = write_table(tmp_path / "partial.csv", {"s0": (0.1, 0.2)}, columns=("groovist", "coherence"))
    with pytest.raises(RewardError, match=r"partial\.csv: no repetition column"):
        dhm_reward(assets, human_scores=missing).setup()
    with pytest.raises(ValueError, match="human_scores: no such file"):
        create_reward("dhm", human_scores=str(tmp_path / "nope.csv"))


def test_unscorable_samples_are_none_through_trl(assets):
    reward = dhm_reward(assets, dimensions=["coherence", "repetition"])
    completions = [MODEL[0], "Only one sentence.", MODEL[2], None, MODEL[4]]
    ids = ["s0", "s0", "s1", "s1", "s2"]
    ctx = context(assets, ids)
    ctx["reference"][4] = None  # no human story for this one
    got = reward(prompts=["p"] * 5, completions=[[{"role": "assistant", "content": c}] for c in completions],
                 trainer_state=None, **ctx)
    want = dhm_reward(assets, dimensions=["coherence", "repetition"]).score(completions, **ctx)
    assert got[1] is None and got[3] is None and got[4] is None
    assert [g for g in got if g is not None] == pytest.approx(list(want[[0, 2]]))
    reasons = reward.stats["reasons"]
    assert reasons["not text"] == 1 and reasons["no human story"] == 1
    assert reasons["repetition: story unscorable"] == 1 and reasons["coherence: story unscorable"] == 1
    assert reward.stats["scored"] == 2 and reward.stats["unscorable"] == 3


class Log:
    def __init__(self):
        self.metrics, self.extra = {}, {}

    def metric(self, name, value):
        assert name not in self.metrics and isinstance(value, float) and math.isfinite(value), name
        self.metrics[name] = value

    def column(self, name, values):
        assert name not in self.extra
        self.extra[name] = values


def test_dhm_logs_every_dimension(assets, independent):
    reward = dhm_reward(assets)
    log = Log()
    completions = [*MODEL, "Only one sentence."]
    ctx = context(assets, [*IDS, "s0"])
    got = reward(prompts=["p"] * 7, completions=completions, log_metric=log.metric, log_extra=log.column, **ctx)
    assert got[-1] is None
    assert log.metrics["dhm/unscorable_frac"] == pytest.approx(1 / 7)
    for dim in ("grounding", "coherence", "repetition"):
        model = independent["model"][dim]
        assert log.metrics[f"dhm/{dim}/mean"] == pytest.approx(np.mean(model), abs=1e-6)  # the NaN left out
        assert log.metrics[f"dhm/{dim}/distance_mean"] == pytest.approx(
            np.mean(independent["distance"][dim]), abs=1e-6)
        assert log.metrics[f"dhm/{dim}/human_mean"] == pytest.approx(
            np.mean([*independent["human"][dim], independent["human"][dim][0]]), abs=1e-6)
        assert log.metrics[f"dhm/{dim}/human_unscorable_frac"] == 0.0
        column = log.extra[f"dhm/{dim}"]
        assert len(column) == 7 and column[:6] == pytest.approx(list(model), abs=1e-6)
        assert log.extra[f"dhm/{dim}/distance"][:6] == pytest.approx(list(independent["distance"][dim]), abs=1e-6)
    assert log.metrics["dhm/repetition/unscorable_frac"] == pytest.approx(1 / 7)
    assert log.extra["dhm/repetition"][-1] is None and log.extra["dhm/coherence"][-1] is None


# -- failing components -------------------------------------------------------------------------


def test_a_component_raising_for_one_story_makes_only_it_none(assets, monkeypatch):
    reward = dhm_reward(assets, dimensions=["coherence", "repetition"])
    reward.score(MODEL, **context(assets))  # human stories cached
    clean = reward.score(MODEL, **context(assets))
    repetition = reward.component_rewards["repetition"]
    original = repetition._score_batch

    def breaks_on_cake(stories, **ctx):
        if any("cake" in s for s in stories):
            raise RuntimeError("boom")
        return original(stories, **ctx)

    monkeypatch.setattr(repetition, "_score_batch", breaks_on_cake)
    coherence_batches = spy(monkeypatch, reward.component_rewards["coherence"])
    got = reward(prompts=["p"] * 6, completions=MODEL, **context(assets))
    assert got[2] is None  # the only model story with "cake"
    assert [g for k, g in enumerate(got) if k != 2] == pytest.approx([c for k, c in enumerate(clean) if k != 2])
    assert reward.stats["reasons"]["repetition: story unscorable"] == 1
    assert repetition.stats["reasons"]["RuntimeError"] == 1
    assert coherence_batches == [MODEL]  # the other component scored the batch once: no story-by-story retry


@pytest.mark.parametrize("kind", ["dhm", "weighted"])
def test_a_component_failing_for_every_story_is_an_error(assets, monkeypatch, kind):
    if kind == "dhm":
        reward = dhm_reward(assets, dimensions=["coherence", "repetition"])
        reward.score(MODEL, **context(assets))
    else:
        reward = create_reward("weighted", components=[{"reward": "repetition"}, {"reward": "repetition"}])
    component = next(iter(reward.component_rewards.values())) if kind == "weighted" else \
        reward.component_rewards["repetition"]

    def broken(stories, **ctx):
        raise RuntimeError("broken metric")

    monkeypatch.setattr(component, "_score_batch", broken)
    with pytest.raises(RewardError, match="broken metric"):
        reward(prompts=["p"] * 6, completions=MODEL, **context(assets))


# -- weighted -----------------------------------------------------------------------------------

W_TEXTS = [
    "The cat sat on the mat. The cat sat on the mat again.",
    "A dog ran to the park. It played with a red ball. Then it slept.",
    "One sentence only.",
    "We went to the beach. The sun was warm and the sea was blue.",
    "The sky is blue. The sky is blue. The sky is blue.",
    "A cat. A dog. A cat and a dog.",
    "The tree was tall. Birds sang in it. The day was long.",
    "Cake. Cake. Cake.",
]
W_PROMPTS = ["p0", "p0", "p0", "p0", "p1", "p1", "p1", "p1"]


def repetition_scores(texts=W_TEXTS):
    return create_reward("repetition").score(texts)


def np_z(x):
    f = np.isfinite(x)
    out = np.full(len(x), np.nan)
    out[f] = (x[f] - x[f].mean()) / x[f].std() if np.ptp(x[f]) else 0.0
    return out


@pytest.mark.parametrize("normalize", ["none", "batch", "group", "range"])
def test_weighted_normalisations_against_numpy(normalize):
    r = repetition_scores()
    assert np.isnan(r[2]) and np.isfinite(np.delete(r, 2)).all()
    term = {"reward": "repetition", "weight": 2.0, "normalize": normalize}
    if normalize == "range":
        term["range"] = [-0.5, 1.5]
    reward = create_reward("weighted", components=[term, {"reward": "repetition", "options": {"chunk_size": 2},
                                                          "weight": -0.5}])
    r2 = create_reward("repetition", chunk_size=2).score(W_TEXTS)
    got = reward(prompts=W_PROMPTS, completions=W_TEXTS)
    if normalize == "none":
        x = r
    elif normalize == "batch":
        x = np_z(r)
    elif normalize == "group":
        x = np.concatenate([np_z(r[:4]), np_z(r[4:])])
    else:
        x = (r + 0.5) / 2.0
    want = 2.0 * x - 0.5 * r2
    assert got[2] is None
    np.testing.assert_allclose([g for k, g in enumerate(got) if k != 2], np.delete(want, 2), rtol=0, atol=1e-12)
    assert list(reward.component_rewards) == ["repetition", "repetition_2"]
    np.testing.assert_allclose(reward.last_components["repetition"], r, equal_nan=True)
    if normalize != "none":
        np.testing.assert_allclose(reward.last_components["repetition/normalized"], x, equal_nan=True)


def test_group_keys_are_prompt_and_story_id():
    r = repetition_scores()
    reward = create_reward("weighted", components=[{"reward": "repetition", "normalize": "group"}])
    # A VLM's prompt text is the same for every sequence: the story id tells the groups apart.
    ids = [0, 0, 0, 0, 1, 1, 1, 1]
    got = np.array(reward(prompts=[[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Tell"}]}]]
                          * 8, completions=W_TEXTS, story_id=ids), dtype=float)
    want = np.concatenate([np_z(r[:4]), np_z(r[4:])])
    np.testing.assert_allclose(got, want, atol=1e-12)
    # Without prompts (storyrl score), story ids alone; without either it is an error.
    np.testing.assert_allclose(reward.score(W_TEXTS, story_id=ids), want, atol=1e-12)
    with pytest.raises(ValueError, match="story_id"):
        reward.score(W_TEXTS)
    # Equal values (and a lone value) give 0, not a division by zero.
    same = ["The cat sat. The dog ran."] * 3 + [W_TEXTS[0]]
    assert reward.score(same, story_id=[0, 0, 0, 1]).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_zero_weight_is_logged_but_its_nan_does_not_count():
    reward = create_reward("weighted", components=[
        {"reward": "repetition", "weight": 1.0},
        {"reward": {"reward": "dhm", "dimensions": ["repetition"]}, "weight": 0.0},
    ])
    log = Log()
    got = reward(prompts=["p"] * 8, completions=W_TEXTS, log_metric=log.metric, log_extra=log.column)
    r = repetition_scores()
    assert got == [None if math.isnan(v) else pytest.approx(v) for v in r]  # dhm (no reference) is NaN: ignored
    assert log.metrics["weighted/dhm/unscorable_frac"] == 1.0 and "weighted/dhm/mean" not in log.metrics
    assert log.extra["weighted/dhm"] == [None] * 8
    assert log.metrics["weighted/repetition/mean"] == pytest.approx(np.nanmean(r))
    assert log.metrics["weighted/repetition/std"] == pytest.approx(np.nanstd(r))
    assert log.metrics["weighted/repetition/unscorable_frac"] == pytest.approx(1 / 8)
    assert log.metrics["weighted/unscorable_frac"] == pytest.approx(1 / 8)
    assert log.extra["weighted/repetition"] == [None if math.isnan(v) else pytest.approx(v) for v in r]


def test_components_get_the_composite_context(monkeypatch):
    reward = create_reward("weighted", components=[{"reward": "repetition"}])
    seen = spy_context(monkeypatch, reward.component_rewards["repetition"])
    reward(prompts=["p"] * 2, completions=W_TEXTS[:2], story_images=[["a.png"], ["b.png"]], story_id=["x", "y"],
           reference=["r1", "r2"], trainer_state=None, log_metric=None, completion_ids=[[1], [2]])
    assert seen == [{"images": [["a.png"], ["b.png"]], "story_id": ["x", "y"], "reference": ["r1", "r2"]}]


def spy_context(monkeypatch, component):
    seen = []
    original = component.score

    def recording(stories, **ctx):
        seen.append(ctx)
        return original(stories, **ctx)

    monkeypatch.setattr(component, "score", recording)
    return seen


# -- options, configs, pickling -------------------------------------------------------------------


def one(**term):
    """Weighted options with one repetition term."""
    return {"components": [{"reward": "repetition", **term}]}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"components": []}, "components: give at least one reward"),
        ({"components": "repetition"}, "option 'components': expected a list"),
        ({"components": [{"reward": "repetition"}, {"reward": "nope"}]}, r"components\[1\]: unknown reward 'nope'"),
        (one(normalize="zscore"), r"components\[0\]: normalize must be one of"),
        (one(normalize="range"), r"components\[0\]: normalize 'range' needs range"),
        (one(normalize="range", range=[1, 0]), "lo < hi"),
        (one(range=[0, 1]), "range is only used with normalize: range"),
        (one(weight="2"), r"components\[0\]: option 'weight': expected a number"),
        (one(weight=math.inf), "weight must be a finite number"),
        (one(options={"chunk": 2}), "reward 'repetition'.*unknown option 'chunk'"),
        ({"components": [{"reward": "repetition", "name": "r"}, {"reward": "repetition", "name": "r"}]},
         "name 'r' is used twice"),
        ({"components": [{"reward": "missing/file.yaml"}]}, "no such reward config file missing/file.yaml"),
        ({"components": [{"reward": {"chunk_size": 2}}]}, "'reward: <name>' key"),
        ({"components": [{"weight": 1.0}]}, r"components\[0\]: missing required option.*'reward'"),
        ({"dimensions": []}, "dimensions: give at least one"),
        ({"dimensions": ["grounding", "style"]}, "dimensions: unknown 'style'"),
        ({"dimensions": ["coherence", "coherence"]}, "dimensions: 'coherence' given twice"),
        ({"weights": {"grounding": -1.0}}, "weights: 'grounding' must be a positive number"),
        ({"dimensions": ["coherence"], "weights": {"grounding": 1.0}}, "weights: 'grounding' is not a selected"),
        ({"sign": 0}, "sign must be one of -1, 1"),
        ({"sign": -1.0}, "option 'sign': expected an integer"),
        ({"rewards": {"style": {}}}, "rewards: 'style' is not a d_HM dimension"),
        ({"rewards": {"grounding": {"bounded": True}}}, "rewards.grounding: d_HM applies tanh"),
        ({"rewards": {"repetition": {"reward": "coherence"}}}, "rewards.repetition: the reward is 'coherence'"),
        ({"rewards": {"repetition": {"chunk_size": 0}}}, "rewards.repetition: reward 'repetition': chunk_size"),
        ({"rewards": {"groovist": {}, "grounding": {}}}, "same dimension"),
    ],
)
def test_option_errors_name_the_option(options, message):
    kind = "weighted" if "components" in options else "dhm"
    with pytest.raises((TypeError, ValueError), match=message):
        create_reward(kind, **options)


def test_unselected_dimension_rewards_are_not_built():
    # A copy of dhm.yaml with fewer dimensions keeps working where the others' files are absent.
    reward = create_reward("dhm", dimensions=["repetition"],
                           rewards={"grounding": "missing/groovist.yaml", "coherence": {"bogus": 1}})
    assert list(reward.component_rewards) == ["repetition"]


def test_a_component_from_a_reward_config_file_with_options(tmp_path):
    path = tmp_path / "rep.yaml"
    path.write_text("reward: repetition\nchunk_size: 3\n")
    reward = create_reward("weighted", components=[{"reward": str(path)},
                                                   {"reward": str(path), "options": {"chunk_size": 5}}])
    assert [r.chunk_size for r in reward.component_rewards.values()] == [3, 5]
    dhm = create_reward("dhm", dimensions=["repetition"], rewards={"repetition": str(path)})
    assert dhm.component_rewards["repetition"].chunk_size == 3


def test_shipped_configs_load(monkeypatch):
    monkeypatch.chdir(REPO)  # component config files are relative to the working directory
    dhm = load_reward_config(REPO / "configs/rewards/dhm.yaml")
    assert dhm.name == "dhm" and dhm.sign == -1
    assert list(dhm.component_rewards) == ["grounding", "coherence", "repetition"]
    assert [r.name for r in dhm.component_rewards.values()] == ["groovist", "coherence", "repetition"]
    assert dhm.component_rewards["grounding"].bounded is False
    no_g = load_reward_config(REPO / "configs/rewards/dhm_no_grounding.yaml")
    assert list(no_g.component_rewards) == ["coherence", "repetition"]
    weighted = load_reward_config(REPO / "configs/rewards/weighted.yaml")
    assert list(weighted.component_rewards) == ["dhm", "groovist", "repetition_monitor"]
    assert [t.normalize for t in weighted.terms.values()] == ["none", "range", "none"]
    assert [t.weight for t in weighted.terms.values()] == [1.0, 0.5, 0.0]
    # The config round-trips through YAML.
    assert type(weighted)(weighted.config_class.from_mapping(weighted.config())).config() == weighted.config()


def test_pickle_round_trip_before_and_after_loading(assets):
    reward = dhm_reward(assets, dimensions=["coherence", "repetition"])
    weighted = create_reward("weighted", components=[{"reward": "repetition", "normalize": "group"},
                                                      {"reward": {"reward": "coherence", **assets["coherence"]}}])
    for r in (reward, weighted):
        clone = pickle.loads(pickle.dumps(r))  # before any model is loaded
        assert clone.__name__ == r.name and clone.config() == r.config()
        args = dict(prompts=["a", "a", "b", "b", "c", "c"], completions=MODEL, **context(assets))
        first = clone(**args)
        assert first == r(**args) and any(v is not None for v in first)
        again = pickle.loads(pickle.dumps(r))  # after loading and scoring
        assert again(**args) == first
        assert list(again.component_rewards) == list(r.component_rewards)
    assert reward.human_cache and pickle.loads(pickle.dumps(reward)).human_cache == reward.human_cache


# -- under TRL's GRPOTrainer ------------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_logs_every_component(tmp_path, monkeypatch):
    """Two real GRPO steps (tiny random LLaMA): TRL takes the composite's
    None rewards and records every component through log_metric / log_extra."""
    from datasets import Dataset
    from tiny_models import chat_tokenizer, tiny_llama
    from trl import GRPOConfig, GRPOTrainer

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    # A vocabulary of a few words and "." so that random completions have sentences (some scorable).
    prompts = ["dog cat .", "sun sea ."]
    tokenizer = chat_tokenizer(["dog cat sun sea ."])
    reward = create_reward("weighted", components=[
        {"reward": "repetition", "normalize": "group"},
        {"reward": {"reward": "dhm", "dimensions": ["repetition"]}, "weight": 0.5},
    ])
    dataset = Dataset.from_dict({"prompt": prompts * 4, "story_id": ["s0", "s1"] * 4,
                                 "reference": [HUMAN["s0"], HUMAN["s1"]] * 4})
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=False,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=24, max_steps=2,
                      logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=tiny_llama(tokenizer), reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/weighted/mean" in entry]
    assert len(logs) == 2
    for entry in logs:
        for name in ("weighted/unscorable_frac", "weighted/repetition/unscorable_frac", "weighted/dhm/unscorable_frac"):
            assert 0.0 <= entry[name] <= 1.0, name
    assert any("weighted/repetition/mean" in entry and "weighted/dhm/mean" in entry for entry in logs)
    # The last batch as TRL recorded it: the extra columns are the components' values, and the
    # rewards are the group z-scored repetition (groups = prompts) plus half the d_HM.
    extra = trainer._logs["extra"]
    assert {"weighted/repetition", "weighted/repetition/normalized", "weighted/dhm"} <= set(extra)
    last = reward.last_components
    for name in ("repetition", "repetition/normalized", "dhm"):
        assert list(extra[f"weighted/{name}"]) == [None if math.isnan(v) else v for v in last[name]]
    rep, dhm = last["repetition"], last["dhm"]
    groups = list(trainer._logs["prompt"])
    assert len(rep) == len(groups) == 8 and np.isfinite(rep).sum() >= 2
    z = np.full(8, np.nan)
    for prompt in set(groups):
        index = [k for k, g in enumerate(groups) if g == prompt]
        z[index] = np_z(rep[index])
    np.testing.assert_allclose(list(trainer._logs["rewards"]["weighted"]), z + 0.5 * dhm, rtol=1e-6, equal_nan=True)
    assert reward.component_rewards["dhm"].stats["human_scored"] == 2  # two stories, scored once each


def test_storyrl_score_finds_human_score_rows_by_story_id(tmp_path):
    """`storyrl score` hands each record's story_id to the reward, so dhm reads
    the human table row of that story (no reference in the records)."""
    import json

    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.rewards.repetition import repetition_score

    stories = {"a": "The dog ran. The dog ran. It slept.", "b": "We swam. The sea was cold. We ate."}
    records = tmp_path / "stories.jsonl"
    records.write_text("".join(json.dumps({"story_id": k, "story": v}) + "\n" for k, v in stories.items()))
    human = {"a": 0.9, "b": 0.25}
    table = tmp_path / "human.csv"
    table.write_text("story_id,repetition\n" + "".join(f"{k},{v}\n" for k, v in human.items()))
    config = tmp_path / "dhm.yaml"
    config.write_text(f"reward: dhm\ndimensions: [repetition]\nhuman_scores: {table}\n")
    out = tmp_path / "scores.csv"
    result = CliRunner().invoke(main, ["score", str(records), "--config", str(config), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = dict(line.split(",") for line in out.read_text().splitlines()[1:])
    for sid, story in stories.items():
        assert float(rows[sid]) == pytest.approx(-abs(human[sid] - repetition_score(story)))
