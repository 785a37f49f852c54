"""RL policies: loading them for training and generating stories from a
trained one.

Kinds (``RLConfig.policy``; ``auto`` reads the model's config):

* ``causal_lm``: any transformers causal LM (``AutoModelForCausalLM`` and
  ``AutoTokenizer``); it sees the prompt text only.
* ``vlm``: any image-text-to-text model (``AutoModelForImageTextToText``
  and ``AutoProcessor``: LLaVA-NeXT, LLaVA, Qwen2-VL, ...). With
  ``freeze_vision_tower`` its vision encoder neither trains nor gets
  adapters.
* ``tapm``: a trained TAPM directory (:class:`storyrl.generators.tapm.TapmModel`),
  for storyrl's PPO only.

Weights load in ``precision`` (auto: bf16 on a CUDA GPU that supports it,
else fp32); ``load_in_4bit`` quantises the base with bitsandbytes NF4 (CUDA
only; it then trains through LoRA). LoRA is a peft ``LoraConfig`` handed to
the trainer, which wraps the model (the reference is the base with adapters
disabled, no second copy).

:func:`generate_stories` runs a trained policy (``OUTPUT_DIR/final``: full
weights or LoRA adapters, with the tokenizer or processor) greedily on
records, with the prompts the policy was trained on.

A model directory of LoRA adapters (a trainer's ``final/`` with
``lora.merge: false``) loads as its base with the adapters merged
(:func:`storyrl.models.pretrained.load_pretrained`): a trainer starting from
it starts from the saved policy, its reference is that policy, and new
adapters record the directory as their base.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storyrl.data import StoryRecord
from storyrl.models.hub import local_copy_hint, require_hub_model
from storyrl.models.pretrained import adapter_base, is_adapter_dir

__all__ = ["Policy", "detect_policy", "generate_stories", "load_policy", "lora_config", "merge_adapters",
           "trl_reference", "vision_parameter_names"]

logger = logging.getLogger(__name__)

#: Module names of vision encoders in transformers VLMs (LLaVA*, BLIP-2, Qwen2-VL, Idefics, ...).
VISION_MODULES = ("vision_tower", "vision_model", "visual", "vision_encoder")
_VISION_REGEX = rf"(.*\.)?({'|'.join(VISION_MODULES)})(\..*)?"
#: What to do when the policy model must come from an unreachable hub.
POLICY_HINT = local_copy_hint("model (the training YAML's key)", "--model")
_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass
class Policy:
    """A loaded policy: the model, its tokenizer or processor, and its kind."""

    model: Any
    processing_class: Any
    kind: str

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processing_class, "tokenizer", self.processing_class)


def _model_type(model: str, revision: str | None, read_hub: bool) -> str | None:
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            return json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (ValueError, OSError, AttributeError) as exc:
            raise ValueError(f"{config}: cannot read the model's config: {exc}") from None
    if is_adapter_dir(model):  # LoRA adapters: the base model tells
        base, base_revision = adapter_base(model)
        return _model_type(base, base_revision, read_hub)
    if not read_hub:
        return None
    from transformers import AutoConfig

    require_hub_model(model, what="policy model", hint=POLICY_HINT)
    try:
        return AutoConfig.from_pretrained(model, revision=revision).model_type
    except (OSError, ValueError) as exc:
        raise ValueError(f"model {model}: cannot read its config: {' '.join(str(exc).split())}") from None


def detect_policy(model: str, revision: str | None = None, read_hub: bool = True) -> str | None:
    """``tapm`` for a trained TAPM directory, ``vlm`` for an image-text-to-text
    model, else ``causal_lm``; None when ``model`` is not a local directory
    and ``read_hub`` is false."""
    model_type = _model_type(model, revision, read_hub)
    if model_type is None:
        return None
    from storyrl.generators import TAPM_MODEL_TYPE

    if model_type == TAPM_MODEL_TYPE:
        return "tapm"
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return "vlm" if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else "causal_lm"


def training_dtype(precision: str):
    """auto = bf16 on a CUDA GPU that supports it, else fp32 (training wants
    no fp16 weights)."""
    import torch

    if precision == "auto":
        from storyrl.models.runtime import cuda_native_bf16

        precision = "bf16" if cuda_native_bf16() else "fp32"
    return getattr(torch, _DTYPES[precision])


def _quantization(config, dtype) -> dict[str, Any]:
    if not config.load_in_4bit:
        return {}
    import torch

    if not torch.cuda.is_available():
        raise ValueError("load_in_4bit needs a CUDA device (bitsandbytes)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError("load_in_4bit needs bitsandbytes: pip install 'storyrl[quant]'") from None
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                               bnb_4bit_use_double_quant=True)
    # Each process holds its whole quantised copy on its own GPU.
    return {"quantization_config": quant, "device_map": {"": PartialState().local_process_index}}


def vision_parameter_names(model) -> list[str]:
    """Parameters of the model's vision encoder (``VISION_MODULES``)."""
    import re

    pattern = re.compile(rf"(^|.*\.)({'|'.join(VISION_MODULES)})\.")
    return [name for name, _ in model.named_parameters() if pattern.match(name)]


def load_policy(config, kind: str | None = None, path: str | None = None) -> Policy:
    """The policy of ``config`` (or the weights in ``path``, e.g. a trained
    policy), ready for a trainer: tokenizers pad on the left, a missing pad
    token is the EOS token, a VLM's vision encoder is frozen when asked.
    Loading errors are one-line ValueErrors naming the model."""
    kind = kind or config.policy_kind()
    name = path or config.model
    revision = None if path else config.revision
    dtype = training_dtype(config.precision)
    require_hub_model(name, what="policy model", hint=POLICY_HINT)
    try:
        if kind == "tapm":
            from transformers import AutoTokenizer

            from storyrl.generators.tapm.model import TapmModel

            model = TapmModel.from_pretrained(name, dtype=dtype)
            processing_class = AutoTokenizer.from_pretrained(name)
        else:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

            from storyrl.models.pretrained import load_pretrained, processor_source

            # Adapters (a trainer's final/ with lora.merge: false) load merged
            # into their base: the policy starts as the one that was saved.
            model_class, processor_class = ((AutoModelForImageTextToText, AutoProcessor) if kind == "vlm"
                                            else (AutoModelForCausalLM, AutoTokenizer))
            model = load_pretrained(model_class, name, revision=revision, dtype=dtype, **_quantization(config, dtype))
            source, source_revision = processor_source(name, revision)
            processing_class = processor_class.from_pretrained(source, revision=source_revision)
    except OSError as exc:
        raise ValueError(f"model {name}: cannot load: {' '.join(str(exc).split())}") from None
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    tokenizer.padding_side = "left"  # generation continues each prompt where it ends
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if kind == "vlm" and config.freeze_vision_tower:
        frozen = set(vision_parameter_names(model))
        for pname, param in model.named_parameters():
            if pname in frozen:
                param.requires_grad_(False)
        if not frozen:
            logger.warning("freeze_vision_tower: %s has no module named %s; nothing frozen", name,
                           " / ".join(VISION_MODULES))
    return Policy(model, processing_class, kind)


@contextmanager
def trl_reference(config, kind: str, trainer_class: type):
    """While TRL's GRPO/RLOO trainer is built: its frozen reference (no
    LoRA, beta > 0), which TRL reloads from the policy's config path
    (``create_model_from_path``: no revision, no 4-bit, and a LoRA-adapter
    directory would load as transformers' own peft integration does), is
    loaded as the policy was (:func:`load_policy`)."""
    import sys

    module = sys.modules[next(c for c in trainer_class.__mro__ if c.__module__.startswith("trl.")).__module__]
    original = module.create_model_from_path

    def reference(model_id: str, **kwargs: Any):
        model = load_policy(config, kind).model
        model.requires_grad_(False)
        return model.eval()

    module.create_model_from_path = reference
    try:
        yield
    finally:
        module.create_model_from_path = original


def lora_config(config, kind: str):
    """The peft ``LoraConfig`` of ``config.lora`` (None when disabled); a
    VLM's vision encoder gets no adapters when it is frozen."""
    if not config.lora.enabled:
        return None
    from peft import LoraConfig

    options = config.lora
    exclude = _VISION_REGEX if kind == "vlm" and config.freeze_vision_tower else None
    # revision: recorded in adapter_config.json, so the next command loads the base at the same commit.
    return LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout,
                      target_modules=options.target_modules, exclude_modules=exclude, task_type="CAUSAL_LM",
                      revision=config.revision)


def merge_adapters(config, directory: str | Path, kind: str) -> None:
    """Replace the LoRA adapters saved in ``directory`` by full weights: the
    configured base with the adapters merged in (its tokenizer/processor
    and any other files stay)."""
    import shutil

    from peft import PeftModel

    directory = Path(directory)
    base = load_policy(config, kind)
    merged = PeftModel.from_pretrained(base.model, directory).merge_and_unload()
    tmp = directory.with_name(directory.name + ".merged.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    merged.save_pretrained(tmp)
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        (directory / name).unlink(missing_ok=True)
    for path in tmp.iterdir():
        path.replace(directory / path.name)
    tmp.rmdir()


# -- generation from a trained policy ------------------------------------------------


def _max_new_tokens(config) -> int:
    algo = config.algorithm_config()
    if config.algorithm == "ppo":
        return algo.response_length
    return algo.max_completion_length


def generate_stories(config, policy_dir: str, records: Sequence[StoryRecord], batch_size: int = 8,
                     max_new_tokens: int | None = None, device: str | None = None) -> dict[str, str | None]:
    """Greedy stories of the trained policy in ``policy_dir`` for ``records``,
    prompted as in training (``config`` is the run's RLConfig); the length
    limit is the algorithm's completion length unless given. ``{story_id:
    story}``, None for a record whose generation failed (logged)."""
    records = list(records)
    # The saved policy's own config tells its kind without asking the hub.
    kind = (config.policy if config.policy != "auto" else None) or detect_policy(policy_dir, read_hub=False) \
        or config.policy_kind()
    max_new_tokens = max_new_tokens or _max_new_tokens(config)
    if kind == "tapm":
        from storyrl.generators.tapm import TapmGenerator

        features = config.ppo.tapm_features if config.ppo is not None else None
        generator = TapmGenerator(model=policy_dir, features=features, image_root=config.image_root,
                                  batch_size=batch_size, max_new_tokens=max_new_tokens, device=device)
        out = generator.generate(records)
        return {r.story_id: out.stories.get(r.story_id) for r in records}

    import torch

    from storyrl.models.runtime import resolve_device
    from storyrl.training.storyteller.rl.data import prompt_rows

    policy = load_policy(config, kind, path=policy_dir)  # weights, or adapters merged into their base
    model = policy.model
    if not config.load_in_4bit:
        model.to(resolve_device(device))
    model.eval()
    stories: dict[str, str | None] = {}
    for start in range(0, len(records), batch_size):
        batch = records[start : start + batch_size]
        try:
            texts = _generate(policy, prompt_rows(config, batch, kind, policy.processing_class), max_new_tokens)
        except Exception:  # noqa: BLE001  (retried one by one: only the failing records fail)
            texts = [_one(config, policy, record, kind, max_new_tokens) for record in batch]
        for record, text in zip(batch, texts):
            stories[record.story_id] = text
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stories


def _one(config, policy: Policy, record: StoryRecord, kind: str, max_new_tokens: int) -> str | None:
    from storyrl.training.storyteller.rl.data import prompt_rows

    try:
        return _generate(policy, prompt_rows(config, [record], kind, policy.processing_class), max_new_tokens)[0]
    except Exception as exc:  # noqa: BLE001
        logger.warning("story %s: generation failed: %s", record.story_id, exc)
        return None


def _generate(policy: Policy, rows: list[dict], max_new_tokens: int, *, do_sample: bool = False,
              temperature: float = 1.0, top_p: float = 1.0, num_return_sequences: int = 1) -> list[str]:
    """Tokenise the rows' prompts as TRL's GRPOTrainer does (chat template
    with the images for conversational prompts, the text as is otherwise)
    and decode the greedy continuations, or with ``do_sample`` sampled ones
    (``temperature``, nucleus ``top_p``; ``num_return_sequences`` per row,
    a row's continuations next to each other; the caller seeds torch)."""
    import torch
    from trl.data_utils import prepare_multimodal_messages

    model, processing_class = policy.model, policy.processing_class
    prompts = [row["prompt"] for row in rows]
    if isinstance(prompts[0], list):
        if policy.kind == "vlm":
            prompts = [prepare_multimodal_messages(p, row.get("images")) for p, row in zip(prompts, rows)]
        # Processors take the tokenizer's options in processor_kwargs, tokenizers directly.
        padding = {"processor_kwargs": {"padding": True}} if policy.kind == "vlm" else {"padding": True}
        inputs = processing_class.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True, return_tensors="pt", **padding)
    else:
        inputs = processing_class(text=prompts, padding=True, return_tensors="pt")
    inputs = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    tokenizer = policy.tokenizer
    with torch.inference_mode():
        # top_k=0: only temperature and top_p shape the distribution (no model-config top-k).
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0,
                    "num_return_sequences": num_return_sequences} if do_sample else {"do_sample": False}
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, num_beams=1,
                             pad_token_id=tokenizer.pad_token_id, **sampling)
    new = out[:, inputs["input_ids"].shape[1]:]
    return [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
