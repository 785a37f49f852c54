"""Precision as part of the model-backed rewards' contract (issue 30), on the
CPU with tiny random-weight models; the precision axis of
test_reward_contract.py runs every reward at fp16 and bf16 against fp32.
Here: the CLIP bug the first GPU run found and its root cause, the other
CLIP towers, the reward model's checkpoint dtype, LoRA adapters, the
composites through their components, and what is refused or raised instead
of a silent NaN per story. Tolerances: ``conftest.precision_tolerance``
(16 machine epsilons of the dtype times the score scale)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import precision_tolerance, shared_path

import storyrl  # noqa: F401  (before torch/transformers: CPU torchvision fallback)
from storyrl.rewards import build_reward, create_reward
from storyrl.rewards.base import Reward, RewardError

pytestmark = pytest.mark.usefixtures("one_thread_module")

STORY = "The dog ran to the park. It saw a red car. The sky was blue."
OTHER = "A cat sat on the old boat. The sea was calm. Birds flew over the city."
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@pytest.fixture(autouse=True)
def _fresh_models():
    """Each test loads its models afresh (a shared one would skip the load checks)."""
    from storyrl.models import release_models

    release_models()
    yield
    release_models()


def _close(got, want, precision: str, what: str) -> float:
    got, want = np.asarray(got, float), np.asarray(want, float)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    diff = float(np.nanmax(np.abs(got - want)))
    atol = precision_tolerance(precision, want)
    assert 0 < diff <= atol, f"{what} at {precision}: max |diff| {diff:.3g}, tolerance {atol:.3g}"
    return diff


# -- CLIP: the bug of the first GPU run --------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_clipscore_runs_at_reduced_precision_with_the_image_towers_dtype(tiny_clip, images, precision):
    """The issue's CPU reproduction: clipscore at fp16/bf16 gave NaN for every
    story ("Input type (torch.FloatTensor) and weight type
    (torch.HalfTensor) should be the same")."""
    import torch

    def make(p):
        return create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, precision=p, device="cpu")

    batch = ([STORY, OTHER], {"images": [images, images[::-1]]})
    want = make("fp32").score(batch[0], **batch[1])
    reward = make(precision)
    got = reward.score(batch[0], **batch[1])
    assert np.isfinite(got).all() and reward.stats["unscorable"] == 0
    _close(got, want, precision, "clipscore")
    model = reward.embedder.model
    dtype = getattr(torch, DTYPES[precision])
    # The root cause: open_clip casts conv/linear/attention weights and keeps
    # the first parameters (embeddings) in fp32.
    assert next(model.parameters()).dtype == torch.float32
    assert model.visual.conv1.weight.dtype == dtype == reward.embedder.dtype


def test_the_disk_cache_keeps_each_precisions_region_vectors_apart(tiny_clip, images, tmp_path):
    from storyrl.models import release_models

    def run(precision):
        release_models()  # a fresh process's view: only the disk cache is shared
        reward = create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, precision=precision,
                               device="cpu", cache_dir=str(tmp_path))
        scores = reward.score([STORY], images=[images])
        return scores, reward.embedder.stats

    fp32, stats = run("fp32")
    assert stats["regions_from_disk"] == 0
    fp16, stats = run("fp16")
    assert stats["regions_from_disk"] == 0 and stats["regions_embedded"] == len(images)  # not fp32's vectors
    again, stats = run("fp16")
    assert stats["regions_from_disk"] == len(images) and stats["regions_embedded"] == 0
    np.testing.assert_array_equal(again, fp16)
    _, stats = run("fp32")
    assert stats["regions_from_disk"] == len(images)  # the fp32 key is the one it always was


@pytest.mark.parametrize("tower", ["resnet", "timm"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resnet_and_timm_towers_take_their_stems_dtype(tmp_path_factory, images, tower, precision):
    """open_clip casts a ModifiedResNet like a ViT (conv/linear weights only)
    and a timm trunk whole: the pixels follow the stem either way, and the
    embeddings agree with fp32 (cosines: scale 1)."""
    import torch
    from tiny_models import save_tiny_clip_tower

    from storyrl.images import Region, load_regions
    from storyrl.models.clip import ClipEmbedder, ClipSpec

    name = save_tiny_clip_tower(tmp_path_factory.mktemp(f"clip_{tower}"), tower)
    regions = [Region(p) for p in images]

    def embed(p):
        embedder = ClipEmbedder(ClipSpec(name, None, "cpu", p))
        return embedder, embedder.embed_regions(regions, load_regions), embedder.embed_texts(["a dog", "the red car"])

    _, want_images, want_texts = embed("fp32")
    embedder, got_images, got_texts = embed(precision)
    assert embedder.dtype == getattr(torch, DTYPES[precision])
    _close(got_images, want_images, precision, f"{tower} image embeddings")
    _close(got_texts, want_texts, precision, f"{tower} text embeddings")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_transformers_text_tower_is_cast_whole(tmp_path, monkeypatch, precision):
    """open_clip's fp16/bf16 leaves a transformers text tower half cast
    (fp32 embeddings into fp16 linear layers: "mat1 and mat2 must have the
    same dtype"); storyrl casts that tower whole."""
    import open_clip
    import torch
    from tiny_models import hf_text_tokenize, save_tiny_clip_hf_text

    from storyrl.models.clip import ClipEmbedder, ClipSpec

    name = save_tiny_clip_hf_text(tmp_path)
    monkeypatch.setattr(open_clip, "get_tokenizer", lambda *a, **k: hf_text_tokenize(tmp_path))
    texts = ["a dog ran to the park .", "the cat sat on a red mat ."]
    want = ClipEmbedder(ClipSpec(name, None, "cpu", "fp32")).embed_texts(texts)
    embedder = ClipEmbedder(ClipSpec(name, None, "cpu", precision))
    dtype = getattr(torch, DTYPES[precision])
    assert {p.dtype for p in embedder.model.text.parameters()} == {dtype}
    _close(embedder.embed_texts(texts), want, precision, "transformers text tower")
    # open_clip alone cannot run it: what the cast mends.
    bare = open_clip.create_model(name, pretrained=None, precision=precision).eval()
    with pytest.raises(RuntimeError, match="same dtype"):
        bare.encode_text(hf_text_tokenize(tmp_path)(texts))


def test_a_tower_that_cannot_run_the_precision_is_refused_at_setup_in_one_line(tiny_clip, images, monkeypatch):
    """The old bug (pixels in fp32 against fp16 weights) reinstated: the
    load-time check refuses the precision, naming the option, before any
    story is scored, instead of NaN for every story."""
    import torch

    import storyrl.models.clip as clip

    monkeypatch.setattr(clip, "image_input_dtype", lambda model: torch.float32)
    reward = create_reward("clipscore", clip_model=tiny_clip, clip_pretrained=None, precision="fp16", device="cpu")
    with pytest.raises(RewardError) as caught:
        reward.setup()
    message = str(caught.value)
    assert "\n" not in message
    assert "cannot run at precision fp16 on cpu" in message and "set the precision option to fp32" in message
    # Scoring raises the loading error itself (a PrecisionError, a ValueError), as for any model that cannot load.
    with pytest.raises(ValueError, match="cannot run at precision fp16 on cpu"):
        reward.score([STORY], images=[images])
    assert reward.stats["scored"] == reward.stats["unscorable"] == 0


# -- failures that are the model's, not a story's ---------------------------------------------------


class _Broken(Reward):
    """Scores through a model whose outputs are not finite."""

    name = "broken"

    def _score_batch(self, stories, **_):
        from storyrl.models.runtime import check_finite

        check_finite(np.full(len(stories), np.inf), "toy model", "fp16")


def test_non_finite_model_outputs_raise_once_instead_of_nan_per_story():
    """Even for one story on the first call (the story-isolation rule would
    give it NaN and go on): the model's failure is the user's to know."""
    reward = _Broken()
    with pytest.raises(RewardError, match="toy model gave non-finite outputs at precision fp16; fp16 overflows"):
        reward.score([STORY])
    with pytest.raises(RewardError, match="set the precision option to bf16 or fp32"):
        reward(prompts=["p", "p"], completions=[STORY, OTHER])
    assert reward.stats["unscorable"] == 0 and not reward.stats["reasons"]


@pytest.fixture(scope="module")
def loud_vrank_dir(tmp_path_factory) -> str:
    """A Vrank whose head multiplies by 1e6: outputs beyond fp16's 65504."""
    import torch
    from tiny_models import bert_wordpiece_tokenizer, vrank_model

    root = tmp_path_factory.mktemp("loud_vrank")
    tokenizer = bert_wordpiece_tokenizer([STORY, OTHER], root / "tok")
    model = vrank_model(len(tokenizer), seed=0).eval()
    with torch.no_grad():
        model.head.weight.mul_(1e6)
        model.head.bias.fill_(1e5)
    model.save_pretrained(root / "model", tokenizer)
    return str(root / "model")


def test_fp16_overflow_is_refused_not_scored_nan(loud_vrank_dir):
    def score(p):
        return create_reward("vrank", model=loud_vrank_dir, device="cpu", precision=p).score(
            [STORY, OTHER], reference=[OTHER, STORY])

    want = score("fp32")
    assert np.isfinite(want).all() and np.abs(want).max() > 65504
    _close(score("bf16"), want, "bf16", "vrank beyond fp16's range")  # bf16 has fp32's range
    # Refused when the model loads (its one probe input already overflows), in one line naming the option.
    with pytest.raises(ValueError, match="non-finite outputs at precision fp16; fp16 overflows above 65504: "
                                         "set the precision option to bf16 or fp32"):
        score("fp16")
    with pytest.raises(RewardError, match="cannot load: .* at precision fp16"):
        create_reward("vrank", model=loud_vrank_dir, device="cpu", precision="fp16").setup()


def test_vrank_pairwise_calls_raise_a_model_failure_once(loud_vrank_dir, monkeypatch):
    """compare and rank go around score(): the same RewardError, not NaN per pair."""
    import storyrl.models.runtime as runtime

    reward = create_reward("vrank", model=loud_vrank_dir, device="cpu", precision="bf16")
    reward.setup()

    def overflow(values, what, precision):
        raise runtime.ModelFailure(f"{what} gave non-finite outputs at precision {precision}")

    monkeypatch.setattr(runtime, "check_finite", overflow)  # as if this batch overflowed
    with pytest.raises(RewardError, match="reward 'vrank': vrank model .* non-finite outputs at precision bf16"):
        reward.compare([STORY], [OTHER])
    with pytest.raises(RewardError, match="non-finite outputs"):
        reward.rank([STORY, OTHER])
    assert not reward.stats["reasons"]


def test_bf16_on_a_cuda_card_without_bf16_is_refused(monkeypatch):
    import torch

    from storyrl.models.runtime import PrecisionError, resolve_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(PrecisionError, match="precision bf16: cuda:0 does not support bfloat16; use fp16 or fp32"):
        resolve_precision("bf16", torch.device("cuda:0"))
    assert resolve_precision("fp16", torch.device("cuda:0")) == "fp16"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"  # torch runs bf16 on every CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("bf16", torch.device("cuda:0")) == "bf16"


# -- the reward model: the precision asked, not the checkpoint's ------------------------------------


@pytest.fixture(scope="module")
def reward_model_dirs(tmp_path_factory) -> dict[str, str]:
    """One random LLaMA reward model saved twice: in fp32 and in bf16 (as a
    run that loaded its backbone in bf16 saves it)."""
    import torch
    from tiny_models import chat_tokenizer, tiny_llama
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("rm")
    tokenizer = chat_tokenizer([STORY, OTHER])
    tiny_llama(tokenizer, seed=0).save_pretrained(root / "lm")
    model = AutoModelForSequenceClassification.from_pretrained(root / "lm", num_labels=1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model.to(dtype).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        (root / name / "storyrl_reward_model.json").write_text(json.dumps({"max_length": 64, "prompt": None}))
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_reward_model_weights_are_held_in_the_precision_asked(reward_model_dirs, precision):
    """transformers 5 loads a checkpoint in the dtype it was saved in: before,
    a bf16-saved reward model ran in bf16 at precision fp32."""
    import torch

    reward = create_reward("reward_model", model=reward_model_dirs["bf16"], device="cpu", precision=precision)
    reward.score([STORY])
    model = reward._loaded()[0]
    assert {p.dtype for p in model.parameters()} == {getattr(torch, DTYPES[precision])}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reward_model_lora_adapters_score_as_fp32_within_rounding(reward_model_dirs, tmp_path, precision):
    """peft keeps LoRA adapters (and the saved score head) in fp32 over a
    fp16/bf16 base; the reward runs that mix."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = AutoModelForSequenceClassification.from_pretrained(reward_model_dirs["fp32"], num_labels=1)
    torch.manual_seed(1)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           task_type="SEQ_CLS", init_lora_weights=False))
    lora.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(reward_model_dirs["fp32"]).save_pretrained(tmp_path)
    (tmp_path / "storyrl_reward_model.json").write_text(json.dumps({"max_length": 64, "prompt": None}))

    def score(p):
        return create_reward("reward_model", model=str(tmp_path), device="cpu", precision=p).score([STORY, OTHER])

    _close(score(precision), score("fp32"), precision, "LoRA reward model")
    # the base under the adapters is held in the precision asked, not the checkpoint's fp32
    reward = create_reward("reward_model", model=str(tmp_path), device="cpu", precision=precision)
    reward.score([STORY])
    model = reward._loaded()[0]
    bases = {m.base_layer.weight.dtype for m in model.modules() if hasattr(m, "base_layer")}
    adapters = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert bases == {getattr(torch, DTYPES[precision])} and adapters == {torch.float32}, (bases, adapters)


# -- composites, through their components ------------------------------------------------------------


def _groovist_options(tiny_clip, precision):
    return {"clip_model": tiny_clip, "clip_pretrained": None, "device": "cpu", "precision": precision,
            "theta": 0.5, "concreteness": str(shared_path("groovist", "concreteness_ratings.csv")),
            "pronouns": str(shared_path("groovist", "all_pronouns.txt"))}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_dhm_with_grounding_scores_as_fp32_within_rounding(tiny_clip, images, precision):
    """d_HM's grounding dimension is GROOViST: it failed on every CUDA run."""
    def score(p):
        reward = create_reward("dhm", dimensions=["grounding", "repetition"],
                               rewards={"grounding": _groovist_options(tiny_clip, p)})
        return reward.score([STORY, OTHER], images=[images, images[::-1]], reference=[OTHER, STORY],
                            noun_phrases=[["the dog", "a red car"], ["the sky"]],
                            reference_noun_phrases=[["the park"], ["trees", "the sea"]])

    want = score("fp32")
    assert np.isfinite(want).all()
    _close(score(precision), want, precision, "dhm")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_weighted_with_clipscore_scores_as_fp32_within_rounding(tiny_clip, images, precision):
    def score(p):
        spec = {"reward": "weighted", "components": [
            {"reward": "clipscore", "options": {"clip_model": tiny_clip, "clip_pretrained": None, "device": "cpu",
                                                "precision": p}},
            {"reward": "repetition", "weight": 0.5}]}
        return build_reward(spec).score([STORY, OTHER], images=[images, images[::-1]])

    want = score("fp32")
    assert np.isfinite(want).all()
    _close(score(precision), want, precision, "weighted")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cosmic_open_clip_image_tower_embeds_as_fp32_within_rounding(tiny_clip, images, tmp_path, precision):
    """COSMiC's other image library (the contract's case uses timm): the
    tower is cast whole and its pixels with it; vectors compared after L2
    normalisation (scale 1), as the head's input they are unnormalised."""
    import torch
    from tiny_models import albert_tokenizer
    from transformers import BertConfig, BertModel

    from storyrl.models.cosmic import EncoderSpec, cosmic_encoders

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    albert_tokenizer([STORY, OTHER]).save_pretrained(tmp_path / "bert")
    spec = EncoderSpec(image_library="open_clip", image_model=tiny_clip, image_pretrained=None,
                       text_model=str(tmp_path / "bert"), max_length=32)

    def embed(p):
        encoders = cosmic_encoders(spec, "cpu", p)
        vecs = torch.nn.functional.normalize(torch.from_numpy(encoders.embed_images(images)), dim=-1)
        return encoders, vecs.numpy()

    _, want = embed("fp32")
    encoders, got = embed(precision)
    assert {p.dtype for p in encoders.image_model.parameters()} == {getattr(torch, DTYPES[precision])}
    _close(got, want, precision, "COSMiC open_clip image tower")


def test_check_runs_refuses_a_reduced_precision_but_not_fp32():
    """A model that fails its load probe at fp16/bf16 is a precision the
    user can change (PrecisionError naming the option); at fp32 the failure
    is the model's own and surfaces as it is (no advice to set fp32)."""
    import torch

    from storyrl.models.runtime import ModelFailure, PrecisionError, check_runs

    def broken():
        raise RuntimeError("weights missing")

    with pytest.raises(RuntimeError, match="^weights missing$"):
        check_runs(broken, "toy", "fp32", "cpu")
    with pytest.raises(PrecisionError, match=r"toy cannot run at precision fp16 on cpu \(weights missing\); set the "
                                             r"precision option to fp32"):
        check_runs(broken, "toy", "fp16", "cpu")
    with pytest.raises(ModelFailure):
        check_runs(lambda: torch.tensor([float("inf")]), "toy", "fp32", "cpu")
    with pytest.raises(PrecisionError, match="toy gave non-finite outputs at precision bf16"):
        check_runs(lambda: torch.tensor([1.0, float("nan")]), "toy", "bf16", "cpu")
    check_runs(lambda: torch.ones(2), "toy", "fp16", "cpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_coherence_runs_under_autocast_at_reduced_precision(precision):
    """RoViST-C holds its weights in the precision's dtype and runs under
    autocast of that dtype (which keeps softmax and layer norm in fp32);
    fp32 runs without autocast."""
    import torch

    from storyrl.models.runtime import autocast_forward

    seen = []

    class Net(torch.nn.Module):
        def forward(self, **batch):
            seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
            return batch["x"]

    dtype = getattr(torch, DTYPES[precision])
    out = autocast_forward(Net(), {"x": torch.ones(1, 2, dtype=dtype)}, torch.device("cpu"), dtype)
    assert out.dtype == torch.float32
    assert seen == [False if precision == "fp32" else dtype]
