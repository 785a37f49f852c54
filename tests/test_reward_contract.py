"""The reward contract, checked once for every registered reward (in the
style of torchmetrics' MetricTester): batched ``score`` equals scoring one
story at a time, a pickled copy scores the same, the TRL call equals
``score`` with NaN as None, a context column of the wrong length is an
error, and ``__name__`` is set (TRL names its columns after it).

Each reward is built cheaply and offline: tiny random-weight models from
``tiny_models``, a local ``storyrl serve`` for ``remote``. Every case's batch
holds at least one story the reward scores and one it cannot (the checks
would pass vacuously on an all-NaN batch), plus a story that is not text.

Precision axis: every reward whose config has a ``precision`` option is
rebuilt from its own config at fp16 and at bf16 and compared with the same
weights at fp32 (scores within the dtype's rounding, NaN where fp32 has NaN),
and the dtype the option names is shown to be the one its layers really run
in; rewards without a model are skipped by it, with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import precision_tolerance, shared_path

import storyrl  # noqa: F401  (before torch/transformers: CPU torchvision fallback)
from storyrl.rewards import REWARDS, Reward, build_reward, create_reward
from storyrl.rewards.base import RewardError

pytestmark = pytest.mark.usefixtures("one_thread_module")

STORY = "The dog ran to the park. It saw a red car. The sky was blue."
OTHER = "A cat sat on the old boat. The sea was calm. Birds flew over the city."
REFERENCE = "A dog runs in the park. A red car drives by. The sky is blue."


@dataclass
class Case:
    """How to build a fresh reward, and a batch (stories and per-story
    context columns) with at least one scorable and one unscorable story."""

    make: Callable[[], Reward]
    stories: list
    context: dict[str, list]
    #: batched vs one at a time: 0 for rewards without a model (exactly equal)
    atol: float = 1e-5


def _take(context: dict[str, list], i: int) -> dict[str, list]:
    return {k: [v[i]] for k, v in context.items()}


# -- the cases -------------------------------------------------------------------------
# One builder per built-in reward: (pytest request) -> Case. Fixtures are
# fetched inside, so that only the models a selected case needs are built.


def _repetition(request) -> Case:
    # "" has no sentences: unscorable.
    return Case(lambda: create_reward("repetition"), [STORY, "the dog the dog the dog .", "", None], {}, atol=0)


def _reference_based(name: str):
    def build(request) -> Case:
        refs = [[REFERENCE, OTHER], [REFERENCE], [], [REFERENCE]]  # [] is no reference: unscorable
        return Case(lambda: create_reward(name, reference_absent=True), [STORY, OTHER, STORY, None],
                    {"references": refs}, atol=0)
    return build


def _clipscore(request) -> Case:
    tiny_clip, images = request.getfixturevalue("tiny_clip"), request.getfixturevalue("images")
    return Case(lambda: create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None),
                [STORY, "A dog runs.", OTHER, None], {"images": [images, [], images[::-1], images]})


def _groovist(request) -> Case:
    tiny_clip, images = request.getfixturevalue("tiny_clip"), request.getfixturevalue("images")
    options = {"theta": 0.5, "concreteness": str(shared_path("groovist", "concreteness_ratings.csv")),
               "pronouns": str(shared_path("groovist", "all_pronouns.txt"))}
    return Case(lambda: create_reward("groovist", clip_model=tiny_clip, clip_pretrained=None, **options),
                ["s", "t", "u", None],
                {"images": [images, images[:2], ["/nope/missing.png"], images],
                 "noun_phrases": [["the dog", "a red car"], ["the sky", "trees"], ["the dog"], ["people"]]})


@pytest.fixture(scope="module")
def coherence_dir(tmp_path_factory) -> str:
    from tiny_models import albert_tokenizer, coherence_model

    directory = tmp_path_factory.mktemp("coherence") / "model"
    model = coherence_model(seed=0, size="small", head_scale=20).eval()
    model.save_pretrained(directory, albert_tokenizer([STORY, OTHER, REFERENCE]))
    return str(directory)


def _coherence(request) -> Case:
    model = request.getfixturevalue("coherence_dir")
    # One sentence: no pair to score.
    return Case(lambda: create_reward("coherence", model=model, batch_size=64),
                [STORY, OTHER, "Only one sentence.", None], {})


def _rovist_vg(request) -> Case:
    model, glove = request.getfixturevalue("rovist_vg_dir"), request.getfixturevalue("glove_path")
    images = request.getfixturevalue("images")
    return Case(lambda: create_reward("rovist_vg", model=model, glove=glove, device="cpu", regions="whole"),
                ["s", "t", "u", None],
                {"images": [images, images[1:], ["/nope/missing.png"], images],
                 "nouns": [["dog", "car"], ["tree"], ["dog"], ["dog"]]})


@pytest.fixture(scope="module")
def vrank_dir(tmp_path_factory) -> str:
    import torch
    from tiny_models import bert_wordpiece_tokenizer, vrank_model

    root = tmp_path_factory.mktemp("vrank")
    tokenizer = bert_wordpiece_tokenizer([STORY, OTHER, REFERENCE], root / "tok")
    model = vrank_model(len(tokenizer), seed=0, initializer_range=0.5).eval()
    with torch.no_grad():
        model.head.bias.zero_()
    model.save_pretrained(root / "model", tokenizer)
    return str(root / "model")


def _vrank(request) -> Case:
    model = request.getfixturevalue("vrank_dir")
    return Case(lambda: create_reward("vrank", model=model, batch_size=3),
                [STORY, OTHER, STORY, None], {"reference": [REFERENCE, OTHER, None, REFERENCE]})


@pytest.fixture(scope="module")
def cosmic_dir(tmp_path_factory) -> str:
    """A random-weight COSMiC head over a tiny timm ResNet and a tiny BERT."""
    import torch
    from tiny_models import albert_tokenizer
    from transformers import BertConfig, BertModel

    from storyrl.models.cosmic import CosmicHead, EncoderSpec, HeadConfig, cosmic_encoders

    root = tmp_path_factory.mktemp("cosmic")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64)
    BertModel(config).save_pretrained(root / "bert")
    albert_tokenizer([STORY, OTHER, REFERENCE]).save_pretrained(root / "bert")
    spec = EncoderSpec(image_library="timm", image_model="resnetv2_50", image_pretrained=None,
                       image_kwargs={"layers": (1, 1, 1, 1), "channels": (8, 16, 32, 64), "stem_chs": 8},
                       text_model=str(root / "bert"), max_length=32)
    encoders = cosmic_encoders(spec, "cpu", "fp32")
    head = CosmicHead(HeadConfig(image_dim=encoders.image_dim, text_dim=encoders.text_dim, encoders=spec))
    head.save_pretrained(root / "head")
    return str(root / "head")


def _cosmic(request) -> Case:
    model, images = request.getfixturevalue("cosmic_dir"), request.getfixturevalue("images")
    # Two sentences for three images: a count mismatch, unscorable.
    return Case(lambda: create_reward("cosmic", model=model, device="cpu", precision="fp32"),
                [STORY, OTHER, "A dog ran. A car.", None],
                {"images": [images, images[::-1], images, images], "reference": [REFERENCE, STORY, OTHER, OTHER]})


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """A random-weight one-output LLaMA classifier saved as storyrl train reward_model saves final/."""
    import json

    from tiny_models import chat_tokenizer, tiny_llama
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("reward_model")
    tiny_llama(chat_tokenizer([STORY, OTHER]), seed=0).save_pretrained(root / "lm")
    chat_tokenizer([STORY, OTHER]).save_pretrained(root / "final")
    AutoModelForSequenceClassification.from_pretrained(root / "lm", num_labels=1).save_pretrained(root / "final")
    (root / "final" / "storyrl_reward_model.json").write_text(json.dumps({"max_length": 64, "prompt": "Tell."}))
    return str(root / "final")


def _reward_model(request) -> Case:
    model = request.getfixturevalue("reward_model_dir")
    # An empty story: unscorable.
    return Case(lambda: create_reward("reward_model", model=model, device="cpu", batch_size=2),
                [STORY, OTHER, "", None], {})


def _dhm(request) -> Case:
    # No reference: no human story to compare with, unscorable.
    return Case(lambda: create_reward("dhm", dimensions=["repetition"]),
                [STORY, OTHER, STORY, None], {"reference": [REFERENCE, STORY, None, REFERENCE]}, atol=0)


def _weighted(request) -> Case:
    spec = {"reward": "weighted", "components": [{"reward": "repetition"},
                                                 {"reward": "bleu", "weight": 0.5,
                                                  "options": {"reference_absent": True}}]}
    return Case(lambda: build_reward(spec), [STORY, OTHER, STORY, None],
                {"references": [[REFERENCE], [STORY], [], [REFERENCE]]}, atol=0)


@pytest.fixture(scope="module")
def repetition_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from storyrl.integrations.server import create_app, run_in_thread

    with run_in_thread(create_app(create_reward("repetition"))) as url:
        yield url


def _remote(request) -> Case:
    url = request.getfixturevalue("repetition_server")
    return Case(lambda: create_reward("remote", url=url), [STORY, "the dog the dog .", "", None], {}, atol=0)


CASES = {
    "repetition": _repetition,
    "bleu": _reference_based("bleu"),
    "rouge_l": _reference_based("rouge_l"),
    "clipscore": _clipscore,
    "groovist": _groovist,
    "coherence": _coherence,
    "rovist_vg": _rovist_vg,
    "vrank": _vrank,
    "cosmic": _cosmic,
    "dhm": _dhm,
    "weighted": _weighted,
    "reward_model": _reward_model,
    "remote": _remote,
}


@pytest.fixture(params=sorted(CASES))
def case(request) -> tuple[str, Case]:
    return request.param, CASES[request.param](request)


def _trl_call(reward: Reward, **kwargs: Any) -> list:
    out = reward(**kwargs)
    return asyncio.run(out) if inspect.iscoroutine(out) else out  # the remote reward's call is async


def _with_nan(scores) -> list:
    return [None if math.isnan(s) else float(s) for s in scores]


# -- the contract -------------------------------------------------------------------------


def test_every_built_in_reward_has_a_case():
    built_in = {n for n in REWARDS.names() if REWARDS.get(n).__module__.startswith("storyrl.")}
    assert built_in == set(CASES)


def test_batched_score_equals_one_story_at_a_time(case):
    name, c = case
    reward = c.make()
    batch = reward.score(c.stories, **c.context)
    assert batch.dtype == np.float64 and batch.shape == (len(c.stories),)
    assert np.isfinite(batch).any() and np.isnan(batch).any(), batch  # both kinds of story, or the check is void
    one = [reward.score([s], **_take(c.context, i))[0] for i, s in enumerate(c.stories)]
    np.testing.assert_allclose(batch, one, rtol=0, atol=c.atol, equal_nan=True, err_msg=name)
    assert reward.stats["scored"] == 2 * int(np.isfinite(batch).sum())
    assert reward.stats["unscorable"] == 2 * int(np.isnan(batch).sum())


def test_pickled_reward_scores_the_same(case):
    name, c = case
    reward = c.make()
    fresh = pickle.loads(pickle.dumps(reward))  # before any model loads
    want = reward.score(c.stories, **c.context)
    used = pickle.loads(pickle.dumps(reward))  # and after
    for copy in (fresh, used):
        assert copy.__name__ == reward.__name__ and copy.config() == reward.config()
        # The same weights and inputs: the same floats.
        np.testing.assert_array_equal(copy.score(c.stories, **c.context), want, err_msg=name)


def test_trl_call_is_score_with_none_for_nan(case):
    _, c = case
    reward = c.make()
    want = _with_nan(reward.score(c.stories, **c.context))
    # Plain strings, and chat messages for the first story: the same text.
    completions = [[{"role": "assistant", "content": c.stories[0]}], *c.stories[1:]]
    logged = {}
    out = _trl_call(reward, prompts=["p"] * len(c.stories), completions=completions, trainer_state=None,
                    completion_ids=[[1]] * len(c.stories), log_metric=logged.__setitem__, **c.context)
    assert isinstance(out, list) and [v is None for v in out] == [v is None for v in want]
    assert all(isinstance(v, float) for v in out if v is not None)
    assert out == want  # exactly: the same batch scored the same way
    assert logged[f"{reward.__name__}/unscorable_frac"] == pytest.approx(want.count(None) / len(want))


def test_a_context_column_of_the_wrong_length_is_an_error(case):
    _, c = case
    reward = c.make()
    short = {**c.context, "story_id": [f"s{i}" for i in range(len(c.stories) - 1)]}
    with pytest.raises(ValueError, match=rf"'story_id' has {len(c.stories) - 1} entries for {len(c.stories)}"):
        reward.score(c.stories, **short)
    with pytest.raises(ValueError, match="'story_id'"):
        _trl_call(reward, prompts=["p"] * len(c.stories), completions=c.stories, **short)
    for key, column in c.context.items():  # the reward's own columns too
        with pytest.raises(ValueError, match=rf"{key!r} has {len(column) - 1} entries"):
            reward.score(c.stories, **{**c.context, key: column[:-1]})


def test_name_is_set(case):
    name, c = case
    reward = c.make()
    assert reward.name == reward.__name__ == name


# -- the precision axis --------------------------------------------------------------------

def _at(reward: Reward, precision: str) -> Reward:
    """A fresh copy of ``reward`` (its own config) at ``precision`` on the CPU."""
    return type(reward)(**{**reward.config(), "precision": precision, "device": "cpu"})


def _model_reward(name: str, c: Case) -> Reward:
    reward = c.make()
    if "precision" not in {f.name for f in dataclasses.fields(reward.config_class)}:
        pytest.skip(f"{name} runs no model of its own: its config has no precision option")
    return reward


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_scores_equal_fp32_within_the_dtypes_rounding(case, precision):
    name, c = case
    reward = _model_reward(name, c)
    want = _at(reward, "fp32").score(c.stories, **c.context)
    low = _at(reward, precision)
    got = low.score(c.stories, **c.context)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name} at {precision}: other NaN")
    atol = precision_tolerance(precision, want)
    diff = float(np.nanmax(np.abs(got - want)))
    assert diff <= atol, f"{name} at {precision}: max |score - fp32 score| = {diff:.3g} > {atol:.3g}"
    # Bit-identical scores would mean the option was ignored (fp32 ran).
    assert diff > 0, f"{name} at {precision} scored exactly as fp32: the precision did not reach the model"
    assert low.stats["unscorable"] == int(np.isnan(want).sum())  # the same stories, for the same reasons


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_precision_is_the_dtype_the_models_layers_run_in(case, precision):
    """Every conv/linear layer the reward runs (from a fresh load, so that no
    cached embedding hides a forward pass) is recorded: at fp16/bf16 the
    option's dtype is among their weights and among their inputs, at fp32
    no other dtype is."""
    import torch
    from torch import nn

    from storyrl.models import release_models

    name, c = case
    reward = _at(_model_reward(name, c), precision)
    ran = []

    def record(module, args, output):
        if isinstance(module, (nn.Linear, nn.Conv2d)) and args and torch.is_tensor(args[0]):
            ran.append((module.weight.dtype, args[0].dtype))

    release_models()
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        reward.score(c.stories, **c.context)
    finally:
        handle.remove()
        release_models()
    assert ran, f"{name}: no conv/linear layer ran"
    weights, inputs = {w for w, _ in ran}, {x for _, x in ran}
    want = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    if precision == "fp32":
        assert weights == inputs == {torch.float32}, (name, weights, inputs)
    else:
        assert want in weights and want in inputs, (name, precision, weights, inputs)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_each_precision_gets_its_own_model_in_one_process(case, precision):
    """A reward at fp32 and one at ``precision`` in one process (a composite
    beside a lone reward, a sweep) do not share one loaded model: after the
    fp32 one has run, the other still runs its layers in its own dtype."""
    import torch
    from torch import nn

    from storyrl.models import release_models

    name, c = case
    reward = _model_reward(name, c)
    release_models()
    _at(reward, "fp32").score(c.stories, **c.context)
    ran = []

    def record(module, args, output):
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            ran.append(module.weight.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        _at(reward, precision).score(c.stories, **c.context)
    finally:
        handle.remove()
        release_models()
    want = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert want in set(ran), f"{name} at {precision} after fp32 ran {set(ran) or 'no layer'}: the fp32 model shared"


def _poison_one_value(output):
    """The module's output with one element set to inf (in place where it is
    a model output object; a new tensor otherwise)."""
    import torch

    if torch.is_tensor(output):
        output = output.clone()
        output.view(-1)[0] = float("inf")
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if value is not None:
            value.view(-1)[0] = float("inf")
            return output
    raise AssertionError(f"no tensor to poison in {type(output).__name__}")


# What overflows in each model reward: the tower whose output one non-finite value reaches.
TOWERS = {
    "clipscore": ("ClipEmbedder", lambda e: e.model.visual),
    "groovist": ("ClipEmbedder", lambda e: e.model.visual),
    "rovist_vg": ("RovistVGEmbedder", lambda e: e.model),
    "cosmic": ("CosmicEncoders", lambda e: e.text_model),
    "coherence": ("Module", lambda m: m),
    "vrank": ("Module", lambda m: m),
    "reward_model": ("Module", lambda m: m),
}


def test_one_non_finite_output_of_any_tower_raises_once(case):
    """One overflowing value (an fp16 overflow in one story) in the output of
    any of a model reward's towers is the model's failure: one RewardError,
    not a NaN for that story (normalising or a softmax would make it NaN
    silently)."""
    import torch

    from storyrl.models import release_models
    from storyrl.models.caches import LruDict
    from storyrl.models.runtime import _SHARED

    name, c = case
    if name not in TOWERS:
        _model_reward(name, c)  # skips a reward without a model
        pytest.fail(f"{name}: add its tower to TOWERS")
    kind, tower = TOWERS[name]
    release_models()
    reward = c.make()
    reward.score(c.stories, **c.context)  # loads the models (setup() would want spaCy for GROOViST's NPs)
    objects = [v for value in _SHARED.values() for v in (value if isinstance(value, tuple) else (value,))]
    if kind == "Module":
        found = [o for o in objects if isinstance(o, torch.nn.Module)]
    else:
        found = [o for o in objects if type(o).__name__ == kind]
    assert found, f"{name}: no {kind} loaded"
    for holder in (*objects, reward):  # embedding caches emptied: the towers run again
        for value in list(vars(holder).values()) if hasattr(holder, "__dict__") else ():
            if isinstance(value, LruDict):
                value.clear()
    if name == "rovist_vg":  # its image tower is a method of the model, not a module of its own
        embed = found[0].model.embed_images
        found[0].model.embed_images = lambda pixels: _poison_one_value(embed(pixels))
        handle = None
    else:
        handle = tower(found[0]).register_forward_hook(lambda module, args, output: _poison_one_value(output))
    try:
        with pytest.raises(RewardError, match="non-finite outputs"):
            reward.score(c.stories, **c.context)
        assert reward.stats["unscorable"] == 0 or "non-finite" not in str(reward.stats["reasons"])
    finally:
        if handle is not None:
            handle.remove()
        release_models()
