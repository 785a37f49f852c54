"""Vision-language models for zero-shot story generation, loaded once.

Any transformers image-text-to-text model loads through the Auto classes
(``AutoProcessor`` + ``AutoModelForImageTextToText``): LLaVA-NeXT
(``llava-hf/llava-v1.6-mistral-7b-hf``, the d_HM paper's model), LLaVA 1.5,
BLIP-2, Qwen2-VL, ... by hub name or local path. dtype: fp16 on CUDA, fp32
on CPU unless asked (``precision``); ``load_in_4bit`` quantises with
bitsandbytes (CUDA). Generation pads on the left, so a batch of prompts of
different lengths continues each prompt where it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from storyrl.models.runtime import resolve_device, resolve_precision, shared_model

__all__ = ["DEFAULT_VLM", "VisionLanguageModel", "load_vlm"]

DEFAULT_VLM = "llava-hf/llava-v1.6-mistral-7b-hf"
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class VisionLanguageModel:
    model: Any
    processor: Any
    device: Any
    #: the transformers ``model_type`` (``llava_next``, ``llava``, ``blip-2``, ...)
    family: str
    #: the hub commit the weights came from (None for a local directory)
    commit: str | None

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None))

    @property
    def language_model_type(self) -> str | None:
        text_config = getattr(self.model.config, "text_config", None)
        return getattr(text_config, "model_type", None)


def load_vlm(
    name: str = DEFAULT_VLM,
    revision: str | None = None,
    device: str | None = None,
    precision: str = "auto",
    load_in_4bit: bool = False,
) -> VisionLanguageModel:
    """The model and processor of ``name`` (hub id or directory), shared by
    every generator asking for the same settings."""
    resolved = resolve_device(device)
    precision = resolve_precision(precision, resolved)
    key = ("vlm", name, revision, str(resolved), precision, load_in_4bit)
    return shared_model(key, lambda: _load(name, revision, resolved, precision, load_in_4bit))


def _load(name: str, revision: str | None, device, precision: str, load_in_4bit: bool) -> VisionLanguageModel:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from storyrl.models.hub import require_hub_model

    dtype = getattr(torch, _DTYPES[precision])
    kwargs: dict[str, Any] = {"revision": revision, "dtype": dtype}
    if load_in_4bit:
        if device.type != "cuda":
            raise ValueError("load_in_4bit needs a CUDA device (bitsandbytes)")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ValueError("load_in_4bit needs bitsandbytes: pip install 'storyrl[quant]'") from None
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device.index or 0}
    from storyrl.models.pretrained import load_pretrained, processor_source

    require_hub_model(name, hint="pass a local copy's directory as the model (storyrl generate --model DIR)")
    source, source_revision = processor_source(name, revision)
    processor = AutoProcessor.from_pretrained(source, revision=source_revision)
    # A trainer's final/ of LoRA adapters loads merged into its base.
    model = load_pretrained(AutoModelForImageTextToText, name, **kwargs)
    if not load_in_4bit:
        model.to(device)
    model.eval()
    tokenizer = getattr(processor, "tokenizer", processor)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # batches need one; generation stops at eos anyway
        tokenizer.pad_token = tokenizer.eos_token
    commit = getattr(model.config, "_commit_hash", None)
    return VisionLanguageModel(model, processor, device, model.config.model_type, commit)
