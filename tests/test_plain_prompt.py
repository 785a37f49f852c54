"""The plain chat format with LLaVA-family models whose processor has no chat
template (a local fine-tune saved without one): the prompt carries the
processor's image token, one per image, so generation works; a model that
needs a token its processor does not name is refused at start (issue 21
item 2). Tiny random-weight models, no hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import save_tiny_vlm, write_images

from storyrl.data import StoryRecord
from storyrl.generators import create_generator

VOCAB = ["a", "the", "dog", "cat", "story", "image", "images", "sentence", "write", "one", "for", "each",
         "of", "these", "is", "story:", "."]


def _drop_chat_template(directory: str) -> str:
    """Remove every trace of a chat template from a saved model directory."""
    root = Path(directory)
    for path in root.glob("chat_template*"):
        path.unlink()
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("chat_template", None)
            path.write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    return {family: _drop_chat_template(save_tiny_vlm(root / family, family, VOCAB))
            for family in ("llava_next", "llava", "blip2")}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return [str(p) for p in write_images(tmp_path_factory.mktemp("img"), n=3, size=(32, 32))]


def _generator(model, **options):
    options.setdefault("sequence_image_size", "12x12")
    return create_generator("prompting", model=model, device="cpu", max_new_tokens=4, **options).setup()


def _spy(generator) -> list[str]:
    prompts = []
    original = generator._engine.generate

    def generate(texts, pictures, decode_prompt=False):
        assert len(texts) == len(pictures)  # one image per prompt
        prompts.extend(texts)
        return original(texts, pictures, decode_prompt)

    generator._engine.generate = generate
    return prompts


@pytest.mark.parametrize(("family", "chat_format"), [("llava", "auto"), ("llava_next", "plain")])
@pytest.mark.parametrize("setting", ["visual", "prev_sentence"])
def test_llava_without_chat_template_generates_with_one_image_token_per_image(models, images, family, chat_format,
                                                                               setting):
    generator = _generator(models[family], chat_format=chat_format, setting=setting)
    assert generator.chat_format == "plain"  # auto: LLaVA 1.5 (LLaMA decoder) without a template
    assert generator._engine.processor.chat_template is None
    prompts = _spy(generator)
    records = [StoryRecord("s0", "x", images=images), StoryRecord("s1", "x", images=images[:2])]
    out = generator.generate(records)
    assert dict(out.failures) == {} and set(out.stories) == {"s0", "s1"}
    assert len(prompts) == (2 if setting == "visual" else 5)  # visual: one sequence image per story
    for prompt in prompts:
        assert prompt.count("<image>") == 1 and prompt.startswith("<image>\n"), prompt
    if setting == "visual":
        assert prompts == [f"<image>\n{generator.prompt_text(n)}" for n in (3, 2)]
    # the text after the token is exactly the unwrapped prompt
    assert generator.wrap("Hi .") == "<image>\nHi ."
    assert generator.wrap("<image>\nHi .") == "<image>\nHi ."  # a template that places it itself keeps one


def test_blip2_plain_stays_the_text_alone(models):
    generator = _generator(models["blip2"])
    assert generator.chat_format == "plain" and generator.wrap("Hi .") == "Hi ."  # its processor adds query tokens


def test_a_model_needing_an_image_token_its_processor_lacks_is_refused_at_start(models, monkeypatch, images):
    monkeypatch.setattr("storyrl.generators.prompting.processor_image_token", lambda processor: None)
    generator = create_generator("prompting", model=models["llava"], device="cpu", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"chat format 'plain' cannot place the image.*--chat-format template"):
        generator.setup()
    with pytest.raises(ValueError, match="--chat-format"):  # generate refuses before any story
        create_generator("prompting", model=models["llava"], device="cpu").generate(
            [StoryRecord("s0", "x", images=images)])


def _stub_vllm(monkeypatch):
    """A stand-in ``vllm`` module (vLLM needs CUDA): the engine's config
    reading is real, the LLM is not."""
    import sys
    import types

    class LLM:
        def __init__(self, **options):
            pass

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=types.SimpleNamespace))


def test_vllm_engine_reads_the_image_token_id_from_the_config(models, monkeypatch, images):
    from transformers import AutoConfig

    from storyrl.generators.engines import image_token_id

    _stub_vllm(monkeypatch)
    want = image_token_id(AutoConfig.from_pretrained(models["llava"]))
    assert isinstance(want, int)
    generator = create_generator("prompting", model=models["llava"], device="cpu", backend="vllm").setup()
    assert generator._engine.image_token_id == want
    blip2 = create_generator("prompting", model=models["blip2"], device="cpu", backend="vllm").setup()
    assert blip2._engine.image_token_id == image_token_id(AutoConfig.from_pretrained(models["blip2"]))
    # so the plain format refuses, at start, a processor that names no image token
    monkeypatch.setattr("storyrl.generators.prompting.processor_image_token", lambda processor: None)
    with pytest.raises(ValueError, match=r"chat format 'plain' cannot place the image"):
        create_generator("prompting", model=models["llava"], device="cpu", backend="vllm").setup()
