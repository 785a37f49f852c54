"""Precision is part of every generator's contract (issue 30): the prompting
generator (LLaVA-NeXT, LLaVA, BLIP-2) and the TAPM generator write stories
at ``precision`` fp16 and bf16 on the CPU, in that dtype (every weight;
the pixels or features go in cast to it, the classic crash), and the
logits of the first greedy step are the fp32 model's within a tolerance.

Tolerance: every weight is rounded to the dtype (relative error eps/2)
and every op's output too, so unlike autocast training nothing stays in
fp32; the first step's logits may differ by ``LOGIT_EPS_FACTOR * eps *
max(1, max |fp32 logit|)``, with ``eps`` the dtype's machine epsilon (a
few ops' rounding, room for other CPUs' kernels); measured here: 0.16 to
0.22 (printed with -s).
"""

from __future__ import annotations

import storyrl  # noqa: F401  (torchvision fallback before transformers/timm)

import pytest
import torch
import tiny_models

from storyrl.data import StoryRecord
from storyrl.generators import create_generator

pytestmark = pytest.mark.usefixtures("one_thread_module")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Allowed first-step logit difference, in units of eps * max(1, max |logit|) (module docs).
LOGIT_EPS_FACTOR = 4.0
VOCAB = ["[INST] [/INST] <s> The dog ran home . A cat sat . five four three two write a story about these images "
         "in sentences using exactly"]


class FirstLogits:
    """Hooks on ``model``: the last position's logits of the first call of
    its output layer (the prompt's step), and the dtype of the pixels its
    vision encoder got (the first module named in ``VISION``)."""

    VISION = ("vision_tower", "vision_model")

    def __init__(self, model) -> None:
        self.logits = None
        self.input_dtypes: set[torch.dtype] = set()
        model.get_output_embeddings().register_forward_hook(self._logits)
        for name, module in model.named_modules():
            if name.split(".")[-1] in self.VISION:
                module.register_forward_pre_hook(self._pixels, with_kwargs=True)
                break

    def _logits(self, module, inputs, output) -> None:
        if self.logits is None:
            self.logits = output[:, -1].detach().float().clone()

    def _pixels(self, module, args, kwargs) -> None:
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        if pixels is not None:
            self.input_dtypes.add(pixels.dtype)


def compare_logits(name: str, precision: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    eps = torch.finfo(DTYPES[precision]).eps
    scale = eps * max(1.0, ref.abs().max().item())
    diff = (got - ref).abs().max().item() / scale
    print(f"{name} {precision}: first-step logits max |diff| = {diff:.2f} eps-units (max |logit| "
          f"{ref.abs().max().item():.3f})")
    assert torch.isfinite(got).all()
    assert diff <= LOGIT_EPS_FACTOR, (name, precision, diff)
    # Greedy picks the same first token wherever fp32's choice is clear of the rounding.
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_EPS_FACTOR * scale
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


# -- prompting ----------------------------------------------------------------------------------


def live_vision_tower(directory: str, seed: int = 0) -> str:
    """The saved tiny BLIP-2 with random weights in its vision encoder:
    ``save_tiny_vlm`` leaves them all zero, so its image features are
    fp32 rounding noise (~1e-9) that LayerNorm blows up, and no precision
    can be compared on them."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.vision_model.named_parameters():
            if "norm" not in name and not param.any():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    dirs = {family: tiny_models.save_tiny_vlm(root / family, family, VOCAB)
            for family in ("llava_next", "llava", "blip2")}
    live_vision_tower(dirs["blip2"])
    return dirs


@pytest.fixture(scope="module")
def square_images(tmp_path_factory):
    return [str(p) for p in tiny_models.write_images(tmp_path_factory.mktemp("img"), n=3, size=(32, 32))]


def prompting_run(model: str, precision: str, images: list[str]):
    """(generator, recorder, stories) of one greedy batch at ``precision``."""
    from storyrl.models.runtime import release_models

    release_models()  # a fresh load at each precision (load_vlm keys its cache by precision anyway)
    generator = create_generator("prompting", model=model, device="cpu", max_new_tokens=4, precision=precision,
                                 sequence_image_size="12x12").setup()
    recorder = FirstLogits(generator._engine.vlm.model)
    records = [StoryRecord("s0", "a human story .", images=images[:3]),
               StoryRecord("s1", "a human story .", images=images[:2])]
    return generator, recorder, generator.generate(records)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava_next", "llava", "blip2"])
def test_prompting_generates_at_fp16_and_bf16_in_that_dtype(vlm_dirs, square_images, family):
    _, reference, ref_out = prompting_run(vlm_dirs[family], "fp32", square_images)
    assert not ref_out.failures and reference.input_dtypes == {torch.float32}
    for precision in ("fp16", "bf16"):
        dtype = DTYPES[precision]
        generator, recorder, out = prompting_run(vlm_dirs[family], precision, square_images)
        model = generator._engine.vlm.model
        # transformers keeps the modules a model declares in fp32 (BLIP-2's Q-Former, at fp16 only)
        kept = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
        dtypes = {name: p.dtype for name, p in model.named_parameters() if p.is_floating_point()}
        assert {d for n, d in dtypes.items() if not any(k in n.split(".") for k in kept)} == {dtype}
        assert {d for n, d in dtypes.items() if any(k in n.split(".") for k in kept)} <= {torch.float32, dtype}
        assert recorder.input_dtypes == {dtype}  # the pixels went in cast to the weights' dtype
        assert not out.failures, out.failures
        assert set(out.stories) == {"s0", "s1"}
        compare_logits(f"prompting {family}", precision, recorder.logits, reference.logits)


# -- TAPM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tapm_dir(tmp_path_factory):
    """A TAPM directory (tiny GPT-2, timm test_resnet features) and its features."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureExtractor, FeatureStore, write_features
    from storyrl.generators.tapm.model import TapmModel

    root = tmp_path_factory.mktemp("tapm")
    paths = tiny_models.write_images(root / "img", n=4)
    stories = tiny_models.write_tapm_stories(root / "stories.jsonl",
                                             [[f"img{(k + j) % 4}" for j in range(3)] for k in range(2)])
    extractor = FeatureExtractor("test_resnet", pretrained=False, device="cpu")
    write_features(root / "features", [(p.stem, str(p)) for p in paths], extractor, batch_size=4)
    decoder_dir = tiny_models.save_tiny_decoder(root / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(decoder_dir)
    store = FeatureStore(str(root / "features"))
    model = TapmModel.from_decoder(AutoModelForCausalLM.from_pretrained(decoder_dir), tokenizer,
                                   {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, backbones=store.backbones,
                                   seed=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {"model": str(root / "model"), "features": str(root / "features"), "stories": stories}


def tapm_run(tapm_dir, precision):
    from storyrl.data import load_stories

    generator = create_generator("tapm", model=tapm_dir["model"], features=tapm_dir["features"], max_new_tokens=4,
                                 precision=precision, device="cpu").setup()
    model = generator._model
    recorder = FirstLogits(model)
    features_seen = set()
    encode = model.encode

    def recorded_encode(features, mask):
        prefix, pooled, directions = encode(features, mask)
        features_seen.add(prefix.dtype)
        return prefix, pooled, directions

    model.encode = recorded_encode
    out = generator.generate(load_stories(tapm_dir["stories"]))
    return model, recorder, features_seen, out


@pytest.mark.slow
def test_tapm_generates_at_fp16_and_bf16_in_that_dtype(tapm_dir):
    _, reference, _, ref_out = tapm_run(tapm_dir, "fp32")
    for precision in ("fp16", "bf16"):
        dtype = DTYPES[precision]
        model, recorder, prefix_dtypes, out = tapm_run(tapm_dir, precision)
        assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {dtype}
        assert prefix_dtypes == {dtype}  # the fp32 features were cast to the weights' dtype
        assert set(out.stories) | set(out.failures) == set(ref_out.stories) | set(ref_out.failures)
        compare_logits("tapm", precision, recorder.logits, reference.logits)


def test_generator_precision_options_are_validated():
    """An unknown precision is refused when the options are read, naming the key."""
    with pytest.raises((TypeError, ValueError), match="precision"):
        create_generator("prompting", model="m", precision="fp8")
    with pytest.raises((TypeError, ValueError), match="precision"):
        create_generator("tapm", model=".", precision="half")


def test_pixel_dtype_is_the_vision_encoders_wherever_it_sits():
    """The vision encoder found by its name at any depth (transformers 5
    LLaVA keeps it at model.vision_tower, Qwen2-VL at model.visual), its
    first floating weight (a quantised tower may start with integer
    storage), and the model's dtype only when there is none."""
    from torch import nn

    from storyrl.generators.engines import pixel_dtype

    class Wrapper(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.head = nn.Linear(2, 2)  # first weight of the whole model: fp32
            inner = nn.Module()
            tower = nn.Module()
            tower.register_buffer("codes", torch.zeros(2, dtype=torch.uint8))
            tower.quantised = nn.Parameter(torch.zeros(2, dtype=torch.uint8), requires_grad=False)
            tower.proj = nn.Linear(2, 2).to(torch.bfloat16)
            setattr(inner, name, tower)
            self.model = inner

        @property
        def dtype(self):
            return torch.float32

    for name in ("vision_tower", "vision_model", "visual", "vision_encoder"):
        assert pixel_dtype(Wrapper(name)) == torch.bfloat16, name
    assert pixel_dtype(Wrapper("language_model")) == torch.float32
