"""storyrl rewards in verl and OpenRLHF (storyrl.integrations): the adapters
give the numbers ``reward.score`` gives on the same stories and context, in
the shapes the frameworks take (checked against their sources: verl's naive /
batch reward managers, OpenRLHF's reward_func example and remote reward
post-processing)."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

import storyrl.integrations.scoring as core
from storyrl.integrations import openrlhf, verl
from storyrl.integrations.openrlhf import reward_func, story_from_query
from storyrl.integrations.verl import compute_score, compute_score_batch
from storyrl.rewards import Reward, create_reward, load_reward_config

STORIES = [
    "The dog ran to the park. The dog ran to the lake. He was happy.",
    "We went to the beach. The sun was hot. We swam all day and ate ice cream.",
    "one sentence only.",  # repetition: unscorable (fewer than 2 sentences)
    "A cat sat. A cat sat. A cat sat.",
]
HUMAN = [
    "A boy and his dog went out. They played in the park. Then they went home.",
    "The family drove to the sea. Everyone swam. It was a good day.",
    "It rained. We stayed in.",
    "The cat slept on the mat. Later it ate. Then it slept again.",
]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(core.CONFIG_ENV, raising=False)
    monkeypatch.delenv(core.FALLBACK_ENV, raising=False)


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def repetition_yaml(tmp_path):
    return write(tmp_path, "repetition.yaml", "reward: repetition\nchunk_size: 4\n")


@pytest.fixture
def dhm_yaml(tmp_path):
    # d_HM along repetition only: a composite reward without models.
    return write(tmp_path, "dhm.yaml", "reward: dhm\ndimensions: [repetition]\n")


def with_fallback(values, fallback=0.0):
    return [fallback if math.isnan(v) else float(v) for v in values]


# -- splitting OpenRLHF queries ---------------------------------------------------


@pytest.mark.parametrize(("query", "prompt", "story"), [
    ("Write a story: The dog ran. It was fun.", "Write a story:", "The dog ran. It was fun."),
    # a BOS token decoded before the prompt
    ("<s>Write a story: The dog ran. It was fun.</s>", "Write a story:", "The dog ran. It was fun."),
    # end markers and padding after the response, with whitespace
    ("P: A story. Two.<|im_end|>\n<|endoftext|><|endoftext|>  ", "P:", "A story. Two."),
    # the prompt is not in the query: the whole query is the story
    ("The dog ran. It was fun.", "Something else", "The dog ran. It was fun."),
    ("The dog ran. It was fun.", None, "The dog ran. It was fun."),
    ("The dog ran. It was fun.", "", "The dog ran. It was fun."),
    # markers inside the story stay; only the first prompt occurrence is cut
    ("P: a </s> b. P: again.", "P:", "a </s> b. P: again."),
])
def test_story_from_query(query, prompt, story):
    assert story_from_query(query, prompt) == story


# -- OpenRLHF reward_func ----------------------------------------------------------


def test_reward_func_equals_reward_score_with_prompts_stripped(repetition_yaml):
    prompts = [f"<|im_start|>user\nTell story {i}<|im_end|>\n<|im_start|>assistant\n" for i in range(len(STORIES))]
    queries = [p + s + "<|im_end|>" for p, s in zip(prompts, STORIES)]
    out = reward_func(queries, prompts, HUMAN, storyrl_config=repetition_yaml)
    expected = create_reward("repetition").score(STORIES)
    assert np.isnan(expected[2]) and np.isfinite(np.delete(expected, 2)).all()
    import torch

    assert isinstance(out["rewards"], torch.Tensor) and out["rewards"].dtype == torch.float32
    assert out["rewards"].tolist() == pytest.approx(with_fallback(expected))
    assert out["scores"].tolist() == out["rewards"].tolist()
    assert out["extra_logs"]["unscorable"].tolist() == [0.0, 0.0, 1.0, 0.0]
    # Without stripping, the chat markup would be part of the story and change the score.
    assert out["rewards"][0].item() != pytest.approx(create_reward("repetition").score([queries[0]])[0])


def test_reward_func_composite_components_and_labels(dhm_yaml):
    labels = [HUMAN[0], {"reference": HUMAN[1], "story_id": "s1", "index": 7}, HUMAN[2],
              {"reference": HUMAN[3], "images": np.array(["a.png", "b.png"])}]
    out = reward_func(STORIES, ["" for _ in STORIES], labels, storyrl_config=dhm_yaml)
    dhm = create_reward("dhm", dimensions=["repetition"])
    expected = dhm.score(STORIES, reference=HUMAN)
    assert out["rewards"].tolist() == pytest.approx(with_fallback(expected))
    # The reward's per-sample components reach OpenRLHF's extra_logs.
    rep = create_reward("repetition")
    logs = out["extra_logs"]
    assert logs["dhm/repetition"].tolist() == pytest.approx(with_fallback(rep.score(STORIES)))
    assert logs["dhm/repetition/human"].tolist() == pytest.approx(with_fallback(rep.score(HUMAN)))
    assert logs["unscorable"].tolist() == [float(math.isnan(v)) for v in expected]
    assert all(len(v) == len(STORIES) for v in logs.values())


def test_reward_func_config_and_fallback_from_environment(repetition_yaml, monkeypatch):
    monkeypatch.setenv(core.CONFIG_ENV, repetition_yaml)
    monkeypatch.setenv(core.FALLBACK_ENV, "-2.5")
    before = core.STATS["fallback"]
    out = reward_func(STORIES, None, None)
    assert out["rewards"].tolist() == pytest.approx(with_fallback(create_reward("repetition").score(STORIES), -2.5))
    assert core.STATS["fallback"] == before + 1


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda y: reward_func("a story", None, None, storyrl_config=y), TypeError, "query must be a list"),
    (lambda y: reward_func(["a", "b"], ["p"], None, storyrl_config=y), ValueError, "prompts has 1 entries for 2"),
    (lambda y: reward_func(["a"], None, ["x", "y"], storyrl_config=y), ValueError, "labels has 2 entries for 1"),
    (lambda y: reward_func([3], None, None, storyrl_config=y), TypeError, r"query\[0\] must be a string"),
    (lambda y: reward_func(["a"], None, [5], storyrl_config=y), TypeError, r"labels\[0\]: expected the human story"),
    (lambda y: reward_func(["a"], None, [{"images": "x.png"}], storyrl_config=y), TypeError,
     "'images' must be a list of strings"),
    (lambda y: reward_func(["a"], None, None, storyrl_fallback=float("nan"), storyrl_config=y), ValueError,
     "finite"),
    (lambda y: reward_func(["a"], None, None), ValueError, "STORYRL_REWARD_CONFIG"),
])
def test_reward_func_rejects_bad_input_with_one_line(repetition_yaml, call, error, message):
    with pytest.raises(error, match=message) as info:
        call(repetition_yaml)
    assert "\n" not in str(info.value)


def test_bad_config_file_is_a_value_error_naming_it(tmp_path):
    bad = write(tmp_path, "bad.yaml", "reward: repetition\nchunk_size: -1\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        reward_func(["a"], None, None, storyrl_config=bad)


def test_reward_is_built_once_per_process_and_file(repetition_yaml, monkeypatch):
    loads = []
    real = core.load_reward_config

    def counting(path, *args, **kwargs):
        loads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(core, "load_reward_config", counting)
    monkeypatch.setattr(core, "_REWARDS", {})
    for _ in range(3):
        reward_func(STORIES[:2], None, None, storyrl_config=repetition_yaml)
        compute_score("vist", STORIES[0], None, storyrl_config=repetition_yaml)
    monkeypatch.setenv(core.CONFIG_ENV, repetition_yaml)
    assert core.reward_from_config() is core.reward_from_config(repetition_yaml)
    assert len(loads) == 1


# -- verl compute_score -------------------------------------------------------------


def test_verl_compute_score_equals_reward_score(repetition_yaml):
    expected = with_fallback(create_reward("repetition").score(STORIES), fallback=-1.0)
    got = [compute_score("vist", s, h, {"story_id": str(i), "index": i}, storyrl_config=repetition_yaml,
                         storyrl_fallback=-1.0, some_new_verl_kwarg=1)
           for i, (s, h) in enumerate(zip(STORIES, HUMAN))]
    assert all(type(v) is float for v in got)  # a plain reward: verl gets floats
    assert got == pytest.approx(expected)
    batch = compute_score_batch(data_sources=["vist"] * 4, solution_strs=STORIES, ground_truths=HUMAN,
                                extra_infos=[None] * 4, storyrl_config=repetition_yaml, storyrl_fallback=-1.0)
    assert batch == pytest.approx(expected)


def test_verl_composite_reward_gives_dicts_with_score_and_components(dhm_yaml):
    dhm = create_reward("dhm", dimensions=["repetition"])
    rep = create_reward("repetition")
    expected = dhm.score(STORIES, reference=HUMAN)
    # ground truth as the human story, or as a mapping carrying it
    truths = [HUMAN[0], {"reference": HUMAN[1]}, HUMAN[2], HUMAN[3]]
    batch = compute_score_batch(["vist"] * 4, STORIES, truths, [{"story_id": f"s{i}"} for i in range(4)],
                                storyrl_config=dhm_yaml)
    single = [compute_score("vist", s, t, {"story_id": f"s{i}"}, storyrl_config=dhm_yaml)
              for i, (s, t) in enumerate(zip(STORIES, truths))]
    for results in (batch, single):
        assert [r["score"] for r in results] == pytest.approx(with_fallback(expected))
        assert [r["dhm/repetition"] for r in results] == pytest.approx(with_fallback(rep.score(STORIES)))
        assert [r["unscorable"] for r in results] == [0.0, 0.0, 1.0, 0.0]
        # verl stacks extra info per key: every sample has the same keys, none NaN
        assert len({tuple(sorted(r)) for r in results}) == 1
        assert all(math.isfinite(v) for r in results for v in r.values())
    assert "score" in batch[0] and "dhm/repetition/distance" in batch[0]


def test_verl_details_switch(repetition_yaml):
    results = compute_score_batch(["v"] * 4, STORIES, None, None, storyrl_config=repetition_yaml,
                                  storyrl_details=True)
    assert [r["unscorable"] for r in results] == [0.0, 0.0, 1.0, 0.0]
    assert set(results[0]) == {"score", "unscorable"}


def test_verl_per_sample_refuses_batch_normalised_reward(tmp_path):
    config = write(tmp_path, "w.yaml", "reward: weighted\ncomponents:\n"
                   "  - {reward: repetition, weight: 1.0, normalize: batch}\n")
    with pytest.raises(ValueError, match="compute_score_batch"):
        compute_score("vist", STORIES[0], None, storyrl_config=config)
    weighted = create_reward("weighted", components=[{"reward": "repetition", "weight": 1.0, "normalize": "batch"}])
    expected = weighted.score(STORIES)
    batch = compute_score_batch(["v"] * 4, STORIES, None, None, storyrl_config=config)
    assert [r["score"] for r in batch] == pytest.approx(with_fallback(expected))
    # an independent check of the batch z-score: (x - mean) / std over the scorable stories
    raw = create_reward("repetition").score(STORIES)
    ok = np.isfinite(raw)
    assert np.asarray(expected)[ok] == pytest.approx((raw[ok] - raw[ok].mean()) / raw[ok].std())


class _ContextSpy(Reward):
    """Records the context each call gets; score = story length."""

    name = "test_integrations_spy"

    def _score_batch(self, stories, **context):
        self.context = context
        return np.array([float(len(s)) for s in stories])


def test_verl_context_from_ground_truth_and_extra_info(monkeypatch):
    spy = _ContextSpy()
    monkeypatch.setattr(core, "reward_from_config", lambda config=None: spy)
    extras = [
        {"story_id": "a", "images": np.array(["1.png", "2.png"]), "index": 0},  # parquet lists come back as arrays
        {"story_id": "b", "story_images": ["3.png"], "images": ["policy.png"], "image_ids": ["i3"],
         "reference": "ignored: ground truth wins"},
        None,
    ]
    out = compute_score_batch(["v"] * 3, ["x", "yy", "zzz"], ["H0", "H1", None], extras)
    assert out == [1.0, 2.0, 3.0]
    # a story's story_images are its images (Reward.__call__'s rule, per story); missing values are None
    assert spy.context == {
        "reference": ["H0", "H1", None],
        "story_id": ["a", "b", None],
        "images": [["1.png", "2.png"], ["3.png"], None],
        "image_ids": [None, ["i3"], None],
    }
    with pytest.raises(ValueError, match="ground_truths has 2 entries for 3"):
        compute_score_batch(["v"] * 3, ["x", "yy", "zzz"], ["H0", "H1"], None)
    with pytest.raises(TypeError, match="sample 0: extra_info: 'story_id' must be a string"):
        compute_score_batch(["v"], ["x"], None, [{"story_id": 3}])


def test_verl_loads_the_module_file_as_verl_does(repetition_yaml):
    # verl: spec_from_file_location("custom_module", custom_reward_function.path), then getattr(name)
    spec = importlib.util.spec_from_file_location("custom_module", verl.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module.compute_score("vist", STORIES[0], None, None, storyrl_config=repetition_yaml)
    assert got == pytest.approx(create_reward("repetition").score(STORIES[:1])[0])
    # and OpenRLHF: importlib on the file, then reward_func
    spec = importlib.util.spec_from_file_location("reward_func", openrlhf.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.reward_func(STORIES[:1], None, None, storyrl_config=repetition_yaml)["rewards"].tolist() == \
        pytest.approx([got])


@pytest.mark.parametrize("normalize", ["group", "batch"])
def test_reward_func_refuses_batch_and_group_normalisation(tmp_path, normalize):
    # OpenRLHF >= 0.10.2 calls reward_func with one sample: a z-score over it is 0 and the component vanishes
    config = write(tmp_path, "g.yaml", "reward: weighted\ncomponents:\n"
                   f"  - {{reward: repetition, weight: 1.0, normalize: {normalize}}}\n"
                   "  - {reward: rouge_l, weight: 0.5}\n")
    with pytest.raises(ValueError, match="OpenRLHF scores one sample per call.*group_norm"):
        reward_func(["P1" + STORIES[0]], ["P1"], [HUMAN[0]], storyrl_config=config)
    ranged = write(tmp_path, "r.yaml", "reward: weighted\ncomponents:\n"
                   "  - {reward: repetition, weight: 1.0, normalize: range, range: [0, 2]}\n")
    raw = create_reward("repetition").score(STORIES[:1])
    assert reward_func(STORIES[:1], None, None, storyrl_config=ranged)["rewards"].tolist() == pytest.approx(raw / 2)


@pytest.mark.parametrize(("config", "labels", "flag"), [
    ("reward: rouge_l\n", ["", ""], True),
    ("reward: bleu\n", None, True),
    ("reward: dhm\ndimensions: [repetition]\n", ["", ""], True),
    ("reward: weighted\ncomponents:\n  - {reward: repetition}\n  - {reward: rouge_l, weight: 0.5}\n", ["", ""], True),
    # a reference-free reward, or a reference-based component with weight 0, scores without labels
    ("reward: repetition\n", ["", ""], False),
    ("reward: weighted\ncomponents:\n  - {reward: repetition}\n  - {reward: rouge_l, weight: 0}\n", ["", ""], False),
])
def test_reward_func_needs_the_label_key_when_the_reward_needs_the_human_story(tmp_path, config, labels, flag):
    path = write(tmp_path, "c.yaml", config)
    queries = STORIES[:2]
    if flag:
        with pytest.raises(ValueError, match=r"2 of 2 labels have none.*--data.label_key.*--label_key"):
            reward_func(queries, None, labels, storyrl_config=path)
        # one label given, one missing: still refused, naming the first missing one
        with pytest.raises(ValueError, match=r"1 of 2 labels have none \(first: labels\[1\]\)"):
            reward_func(queries, None, [HUMAN[0], ""], storyrl_config=path)
        out = reward_func(queries, None, HUMAN[:2], storyrl_config=path)
        assert out["rewards"].tolist() == pytest.approx(
            load_reward_config(path).score(queries, reference=HUMAN[:2]).tolist(), rel=1e-6)
    else:
        out = reward_func(queries, None, labels, storyrl_config=path)
        assert out["rewards"].tolist() == pytest.approx(load_reward_config(path).score(queries).tolist(), rel=1e-6)


def test_dhm_with_a_human_score_table_needs_story_ids_not_references():
    from storyrl.integrations.openrlhf import needs_reference

    assert needs_reference(create_reward("dhm", dimensions=["repetition"])) == ("reference",)
    assert needs_reference(create_reward("repetition")) is None


class _ShiftingColumns(Reward):
    """Logs a different per-story column on each call (as a reward whose
    optional parts come and go might)."""

    name = "test_integrations_shifting"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_calls = 0

    def __call__(self, prompts=None, completions=None, **kwargs):
        out = super().__call__(prompts=prompts, completions=completions, **kwargs)
        self.n_calls += 1
        kwargs["log_extra"](f"part{self.n_calls}", [1.0] * len(out))
        return out

    def _score_batch(self, stories, **context):
        return np.array([float(len(s)) for s in stories])


def test_verl_dicts_keep_the_keys_of_the_first_call(monkeypatch):
    reward = _ShiftingColumns()
    monkeypatch.setattr(core, "reward_from_config", lambda config=None: reward)
    first, second = compute_score("v", "ab", None), compute_score("v", "abc", None, fallback_is_unused=1)
    assert first == {"score": 2.0, "part1": 1.0, "unscorable": 0.0}
    # verl stacks each key over samples: a key missing from one sample would misalign them
    assert second == {"score": 3.0, "part1": 0.0, "unscorable": 0.0}


# -- verl's reward loop: compute_score_async and GDPO ----------------------------------


class _CallSpy(Reward):
    """Records the stories of each call; score = story length."""

    name = "test_integrations_calls"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _score_batch(self, stories, **context):
        self.calls.append(list(stories))
        return np.array([float(len(s)) for s in stories])


#: The longest a gather of verl calls may take here: far above the batching waits these tests use
#: (verl's 5 ms default, 200 ms), far below what a batcher reading them as seconds would take.
WAIT_S = 4.0


def _gather(calls, timeout: float = WAIT_S):
    """The calls' results, run concurrently on one loop; TimeoutError past ``timeout``."""
    import asyncio

    async def main():
        return await asyncio.wait_for(asyncio.gather(*calls()), timeout)

    return asyncio.run(main())


def test_verl_async_calls_of_one_loop_share_reward_calls(monkeypatch):
    spy = _CallSpy()
    monkeypatch.setattr(core, "reward_from_config", lambda config=None: spy)
    stories = [f"story {'x' * i}" for i in range(7)]

    # a batch that never fills waits 1 s: 10 s bounds it (a batcher taking ms for s would wait 1000 s)
    out = _gather(lambda: [verl.compute_score_async("v", s, None, storyrl_wait_ms=1000) for s in stories], 10)
    assert out == [float(len(s)) for s in stories]  # each call gets its own story's score
    assert len(spy.calls) == 1 and sorted(spy.calls[0]) == sorted(stories)
    spy.calls.clear()
    out = _gather(lambda: [verl.compute_score_async("v", s, None, storyrl_wait_ms=1000, storyrl_batch_size=3)
                           for s in stories], 10)
    assert out == [float(len(s)) for s in stories]
    assert [len(c) for c in spy.calls] == [3, 3, 1]
    spy.calls.clear()
    # the sync form: one reward call per story
    assert [verl.compute_score("v", s, None) for s in stories[:2]] == [float(len(s)) for s in stories[:2]]
    assert spy.calls == [[stories[0]], [stories[1]]]


def test_verl_async_refuses_a_group_normalised_reward(tmp_path):
    config = write(tmp_path, "g.yaml", "reward: weighted\ncomponents:\n"
                   "  - {reward: repetition, weight: 1.0, normalize: group}\n")
    with pytest.raises(ValueError, match="storyrl_gdpo"):
        _gather(lambda: [verl.compute_score_async("v", STORIES[0], None, {"story_id": "a"}, storyrl_config=config)])


def test_verl_gdpo_gives_raw_components_whatever_the_company(tmp_path):
    config = write(tmp_path, "g.yaml", "reward: weighted\ncomponents:\n"
                   "  - {reward: repetition, weight: 0.25, normalize: group}\n"
                   "  - {reward: rouge_l, weight: 2.0, normalize: range, range: [0, 0.5]}\n"
                   "  - {reward: bleu, weight: 0}\n")
    repetition = create_reward("repetition").score(STORIES)
    rouge = create_reward("rouge_l").score(STORIES, reference=HUMAN)
    ids = ["a", "a", "b", "b"]
    alone = [verl.compute_score("v", s, h, {"story_id": i}, storyrl_config=config, storyrl_gdpo=True)
             for s, h, i in zip(STORIES, HUMAN, ids)]
    together = _gather(lambda: [verl.compute_score_async("v", s, h, {"story_id": i}, storyrl_config=config,
                                                         storyrl_gdpo=True, storyrl_wait_ms=1000)
                                for s, h, i in zip(STORIES, HUMAN, ids)])
    assert alone == together  # one story's values do not depend on the others scored with it
    for k, result in enumerate(alone):
        assert result["weighted/rouge_l"] == pytest.approx(rouge[k])
        if math.isnan(repetition[k]):  # unscorable: flagged, and the fallback everywhere
            assert result["unscorable"] == 1.0 and result["score"] == 0.0
            continue
        assert result["weighted/repetition"] == pytest.approx(repetition[k])
        # the logged total: weights on the raw values (a range still maps to [0, 1])
        assert result["score"] == pytest.approx(0.25 * repetition[k] + 2.0 * rouge[k] / 0.5)
    assert verl.gdpo_settings(config)["gdpo_reward_keys"] == ["weighted/repetition", "weighted/rouge_l"]
    with pytest.raises(TypeError, match="storyrl_gdpo must be true or false"):
        verl.compute_score("v", STORIES[0], None, storyrl_config=config, storyrl_gdpo="yes")
    # a reward without group normalisation is scored as it is
    plain = write(tmp_path, "p.yaml", "reward: repetition\n")
    assert verl.compute_score("v", STORIES[0], None, storyrl_config=plain, storyrl_gdpo=True) == pytest.approx(
        repetition[0])


def test_verl_ground_truth_read_back_from_parquet_as_a_numpy_scalar(monkeypatch):
    spy = _ContextSpy()
    monkeypatch.setattr(core, "reward_from_config", lambda config=None: spy)
    verl.compute_score("v", "story", np.array("the human story", dtype=object))
    assert spy.context == {"reference": ["the human story"]}


def test_a_remote_reward_config_works_in_verl_and_openrlhf(tmp_path):
    # reward: remote is async (TRL's contract): the integrations' sync paths must run it, not return a coroutine
    from storyrl.integrations.server import create_app, run_in_thread

    local = create_reward("dhm", dimensions=["repetition"])
    expected = with_fallback(local.score(STORIES, reference=HUMAN))
    # the server's batching is not tested here (max_wait_ms 0); each request is bounded (timeout_s)
    with run_in_thread(create_app(create_reward("dhm", dimensions=["repetition"]), max_wait_ms=0)) as url:
        config = write(tmp_path, "remote.yaml", f"reward: remote\nurl: {url}\nsend_context: [reference]\n"
                       f"timeout_s: {WAIT_S}\nretries: 0\n")
        sync = [verl.compute_score("v", s, h, storyrl_config=config) for s, h in zip(STORIES, HUMAN)]
        together = _gather(lambda: [verl.compute_score_async("v", s, h, storyrl_config=config)
                                    for s, h in zip(STORIES, HUMAN)])
        out = reward_func(STORIES, None, HUMAN, storyrl_config=config)
    for got in (sync, together):
        assert [r["score"] if isinstance(r, dict) else r for r in got] == pytest.approx(expected)
    assert out["rewards"].tolist() == pytest.approx(expected)


# -- break-review survivors (r1) ------------------------------------------------------


def test_one_reward_per_file_however_it_is_named(tmp_path, monkeypatch):
    write(tmp_path, "r.yaml", "reward: repetition\n")
    monkeypatch.chdir(tmp_path)
    same = core.reward_from_config("r.yaml")
    assert core.reward_from_config(str(tmp_path / "r.yaml")) is same
    assert core.reward_from_config("./r.yaml") is same
    # the GDPO cache agrees: a non-normalised config is the very same reward, not a second copy
    assert verl._reward("r.yaml", True) is same
    other = tmp_path / "sub"
    other.mkdir()
    write(other, "r.yaml", "reward: rouge_l\n")
    monkeypatch.chdir(other)
    assert core.reward_from_config("r.yaml").name == "rouge_l"  # a relative name is the file it names now


def test_gdpo_by_hand_on_a_config_gdpo_cannot_stand_for_is_refused(tmp_path):
    batch = write(tmp_path, "b.yaml", "reward: weighted\ncomponents:\n"
                  "  - {reward: repetition, weight: 1.0, normalize: batch}\n")
    mixed = write(tmp_path, "m.yaml", "reward: weighted\ncomponents:\n"
                  "  - {reward: repetition, weight: 1.0, normalize: group}\n  - {reward: rouge_l, weight: 0.5}\n")
    only_logged = write(tmp_path, "o.yaml", "reward: weighted\ncomponents:\n"
                        "  - {reward: repetition, weight: 0, normalize: group}\n"
                        "  - {reward: rouge_l, weight: 1.0, normalize: range, range: [0, 1]}\n")
    with pytest.raises(ValueError, match="normalize: batch"):
        verl.compute_score("v", STORIES[0], HUMAN[0], storyrl_config=batch, storyrl_gdpo=True)
    with pytest.raises(ValueError, match="component 'rouge_l' has normalize: none"):
        verl.compute_score("v", STORIES[0], HUMAN[0], storyrl_config=mixed, storyrl_gdpo=True)
    with pytest.raises(ValueError, match="no component with a weight uses normalize: group"):
        verl.gdpo_settings(only_logged)


def test_async_configs_in_one_loop_keep_their_own_rewards(tmp_path):
    repetition = write(tmp_path, "a.yaml", "reward: repetition\n")
    rouge = write(tmp_path, "b.yaml", "reward: rouge_l\n")
    out = _gather(lambda: [verl.compute_score_async("v", s, h, storyrl_config=c, storyrl_wait_ms=200)
                           for s, h in zip(STORIES[:2], HUMAN[:2]) for c in (repetition, rouge)])
    want = []
    for s, h in zip(STORIES[:2], HUMAN[:2]):
        want += [create_reward("repetition").score([s])[0], create_reward("rouge_l").score([s], reference=[h])[0]]
    assert out == pytest.approx(want)


def test_dhm_with_a_human_score_table_takes_story_ids_as_labels(tmp_path):
    from storyrl.integrations.openrlhf import check_labels, needs_reference

    table = write(tmp_path, "human.csv", "story_id,non_redun_score\na,0.9\nb,0.8\n")
    dhm = create_reward("dhm", dimensions=["repetition"], human_scores=table)
    assert needs_reference(dhm) == ("reference", "story_id")
    check_labels(dhm, [{"story_id": "a"}, {"reference": "A human story. Two."}])  # either will do
    with pytest.raises(ValueError, match=r"1 of 2 labels have none \(first: labels\[1\]\)"):
        check_labels(dhm, [{"story_id": "a"}, {}])
    assert needs_reference(create_reward("dhm", dimensions=["repetition"])) == ("reference",)


def test_groups_of_one_are_found_when_some_prompts_are_missing():
    from storyrl.integrations.openrlhf import check_company

    weighted = create_reward("weighted", components=[{"reward": "repetition", "normalize": "group"}])
    # prompts given for some stories: a missing prompt is its own group key, never pooled by story_id alone
    with pytest.raises(ValueError, match="some of one story"):
        check_company(weighted, [{"story_id": "s"}] * 3, ["P", "P", None])
    check_company(weighted, [{"story_id": "s"}] * 4, ["P", "P", None, None])
    check_company(weighted, [{"story_id": "s"}, {"story_id": "s"}], [None, None])
    check_company(create_reward("repetition"), [{}], [None])  # not normalised: anything goes


def test_fallback_and_column_checks():
    with pytest.raises(TypeError, match="must be a number"):
        core.resolve_fallback(True)
    with pytest.raises(ValueError, match="extra_infos has 3 entries for 2 stories"):
        compute_score_batch(None, STORIES[:2], None, [None, None, None])
    from storyrl.integrations.openrlhf import split_queries

    assert split_queries(["a story."], None, [""])[1] == [{}]  # "" is OpenRLHF's "no label", not a reference
