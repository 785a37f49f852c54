"""Generation backends of the prompting generator: one prompt and one image
per request, a batch of requests per call.

* :class:`TransformersEngine` (default): ``model.generate`` on a left-padded
  batch (:func:`storyrl.models.load_vlm`).
* :class:`VllmEngine`: vLLM's offline ``LLM.generate`` (``pip install
  'storyrl[vllm]'``, CUDA), the fast engine for large sweeps. vLLM returns
  the continuation only; with ``decode_prompt`` the prompt text is put in
  front, as the transformers engine decodes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Decoding", "TransformersEngine", "VllmEngine", "create_engine", "image_token_id", "pixel_dtype"]


@dataclass(frozen=True)
class Decoding:
    """Decoding parameters; greedy unless ``do_sample``."""

    max_new_tokens: int = 500
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    num_beams: int = 1
    seed: int = 0

    def generate_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample,
                                  "num_beams": self.num_beams}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:  # a model's generation_config may carry sampling values; greedy ignores them
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs


def image_token_id(config) -> int | None:
    """The id of the placeholder token the model replaces by image features
    (LLaVA-family configs), or None for models without one (e.g. BLIP-2 before
    transformers gave it one)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


#: Module names of vision encoders in transformers VLMs (LLaVA*, BLIP-2, Qwen2-VL, ...).
VISION_MODULES = ("vision_tower", "vision_model", "visual", "vision_encoder")


def pixel_dtype(model) -> Any:
    """The dtype the model's vision encoder computes in (its first floating
    weight's), which the pixels must have. Not ``model.dtype``: that is the
    first weight of the whole model, which may belong to a module
    transformers keeps in fp32 (BLIP-2's query tokens) while the vision
    encoder runs in fp16."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULES:
            for param in module.parameters():
                if param.is_floating_point():
                    return param.dtype
    return model.dtype


class TransformersEngine:
    def __init__(self, model: str, revision: str | None, device: str | None, precision: str, load_in_4bit: bool,
                 decoding: Decoding) -> None:
        from storyrl.models.vlm import load_vlm

        self.vlm = load_vlm(model, revision, device, precision, load_in_4bit)
        self.decoding = decoding
        self.processor = self.vlm.processor
        self.family = self.vlm.family
        self.text_model_type = self.vlm.language_model_type
        self.commit = self.vlm.commit
        self.image_token_id = image_token_id(getattr(self.vlm.model, "config", None))
        import torch

        torch.manual_seed(decoding.seed)

    def generate(self, prompts: Sequence[str], images: Sequence[Any], decode_prompt: bool = False) -> list[str]:
        import torch

        vlm = self.vlm
        inputs = vlm.processor(images=list(images), text=list(prompts), return_tensors="pt", padding=True)
        inputs = inputs.to(vlm.device)
        if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(pixel_dtype(vlm.model))
        tokenizer = vlm.tokenizer
        with torch.inference_mode():
            out = vlm.model.generate(**inputs, pad_token_id=tokenizer.pad_token_id, **self.decoding.generate_kwargs())
        if not decode_prompt:
            out = out[:, inputs["input_ids"].shape[1]:]
        return tokenizer.batch_decode(out, skip_special_tokens=True)


class VllmEngine:
    def __init__(self, model: str, revision: str | None, device: str | None, precision: str, load_in_4bit: bool,
                 decoding: Decoding) -> None:
        from storyrl.models.pretrained import is_adapter_dir

        if is_adapter_dir(model):  # vLLM reads full weights; storyrl merges adapters for transformers only
            raise ValueError(f"backend 'vllm': {model} holds LoRA adapters, not a model; train with lora.merge: true "
                             "(full weights) or use backend transformers, which loads them merged into their base")
        try:
            from vllm import LLM, SamplingParams
        except ImportError:
            raise ValueError("backend 'vllm' needs vLLM: pip install 'storyrl[vllm]' (CUDA machines)") from None
        if decoding.num_beams != 1:
            raise ValueError("backend 'vllm': beam search (num_beams > 1) is not supported; use backend transformers")
        from transformers import AutoConfig, AutoProcessor

        dtype = {"auto": "auto", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[precision]
        options: dict[str, Any] = {"model": model, "revision": revision, "dtype": dtype, "seed": decoding.seed,
                                   "limit_mm_per_prompt": {"image": 1}}
        if load_in_4bit:
            options["quantization"] = "bitsandbytes"
        if device not in (None, "auto", "cuda"):
            options["device"] = device
        from storyrl.models.hub import require_hub_model

        require_hub_model(model, hint="pass a local copy's directory as the model (storyrl generate --model DIR)")
        self.processor = AutoProcessor.from_pretrained(model, revision=revision)
        config = AutoConfig.from_pretrained(model, revision=revision)
        self.family = config.model_type
        self.text_model_type = getattr(getattr(config, "text_config", None), "model_type", None)
        self.commit = getattr(config, "_commit_hash", None)
        self.image_token_id = image_token_id(config)
        self.llm = LLM(**options)
        self.params = SamplingParams(
            max_tokens=decoding.max_new_tokens,
            temperature=decoding.temperature if decoding.do_sample else 0.0,
            top_p=decoding.top_p if decoding.do_sample else 1.0,
            top_k=decoding.top_k if decoding.do_sample and decoding.top_k > 0 else -1,
            seed=decoding.seed,
        )

    def generate(self, prompts: Sequence[str], images: Sequence[Any], decode_prompt: bool = False) -> list[str]:
        requests = [{"prompt": p, "multi_modal_data": {"image": image}} for p, image in zip(prompts, images)]
        outputs = self.llm.generate(requests, self.params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outputs]
        if decode_prompt:
            texts = [p.replace("<image>", "") + t for p, t in zip(prompts, texts)]
        return texts


_ENGINES = {"transformers": TransformersEngine, "vllm": VllmEngine}


def create_engine(backend: str, **options: Any):
    return _ENGINES[backend](**options)
