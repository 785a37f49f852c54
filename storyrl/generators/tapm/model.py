"""The TAPM model as a transformers ``PreTrainedModel`` with ``generate``.

Inputs of :meth:`TapmModel.forward`: ``input_ids`` whose first P positions are
placeholders for the visual prefix, followed by the sentence's start token and
its tokens, and ``visual_prefix`` (N, P, H), whose rows replace the
placeholders' embeddings. ``generate`` passes the prefix on the first step
only; later steps run on the KV cache. :meth:`TapmModel.encode` turns a batch
of stories' features into one prefix per image.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from storyrl.generators.tapm.config import LORA_DEFAULTS, TapmConfig
from storyrl.generators.tapm.encoder import VisualEncoder

__all__ = ["TapmModel", "load_decoder", "start_token_id"]

WEIGHTS = "model.safetensors"


def start_token_id(tokenizer) -> int:
    """The token each sentence starts from (whose decoder state the adaptation
    loss uses): BOS, else EOS (GPT-2's ``<|endoftext|>`` is both)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("TAPM: the decoder's tokenizer has neither a BOS nor an EOS token")
    return token


def _check_quantization(quantization: str | None) -> None:
    if quantization is None:
        return
    if quantization != "4bit":
        raise ValueError(f"TAPM: quantization must be '4bit' or null, got {quantization!r}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("4-bit decoders need bitsandbytes (pip install 'storyrl[quant]') and a CUDA GPU")
    if not torch.cuda.is_available():
        raise RuntimeError("4-bit decoders need a CUDA GPU (bitsandbytes); none is available")


def load_decoder(name: str, quantization: str | None = None, dtype: torch.dtype | None = None, *,
                 hint: str = "pass a local copy's directory as the decoder"):
    """A causal LM by hub name or local path; ``quantization="4bit"`` loads it
    in NF4 through bitsandbytes (QLoRA style) and prepares it for k-bit training.
    ``hint``: what to do when the hub cannot be reached (HubUnreachableError)."""
    from storyrl.models.hub import require_hub_model

    _check_quantization(quantization)
    require_hub_model(name, what="TAPM decoder", hint=hint)
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if quantization == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    decoder = AutoModelForCausalLM.from_pretrained(name, **kwargs)
    if quantization == "4bit":
        from peft import prepare_model_for_kbit_training

        decoder = prepare_model_for_kbit_training(decoder, use_gradient_checkpointing=False)
    return decoder


def _is_base_decoder_key(key: str) -> bool:
    return key.startswith("decoder.") and "lora_" not in key


class TapmModel(PreTrainedModel, GenerationMixin):
    """Visual encoder (:class:`VisualEncoder`) + causal-LM decoder (optionally
    with LoRA adapters). See the package docs for the architecture."""

    config_class = TapmConfig
    base_model_prefix = "tapm"
    main_input_name = "input_ids"
    _supports_cache_class = True

    def __init__(self, config: TapmConfig, decoder=None) -> None:
        super().__init__(config)
        if decoder is None:
            if config.text_config is None:
                raise ValueError("TAPM: the config has no text_config and no decoder was given")
            decoder = AutoModelForCausalLM.from_config(config.text_config)
        if config.lora and not hasattr(decoder, "peft_config"):
            from peft import LoraConfig, get_peft_model

            decoder = get_peft_model(decoder, LoraConfig(task_type="CAUSAL_LM", **config.lora))
        self.decoder = decoder
        self.visual = VisualEncoder(config.feature_dims, config.width, config.hidden_size, config.neighbours,
                                    config.num_residual_blocks, config.dropout)
        self.visual.to(next(decoder.parameters()).device)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_decoder(cls, decoder: str | Any, tokenizer, feature_dims: dict[str, int],
                     feature_tokens: dict[str, int] | None = None, *, lora: bool | dict | None = None,
                     quantization: str | None = None, save_base_decoder: bool | None = None,
                     encoder_dim: int | None = None, dropout: float = 0.5, backbones: dict | None = None,
                     seed: int | None = None) -> "TapmModel":
        """A new TAPM on a pretrained decoder (name, path or model);
        ``lora=True`` uses the paper's adapters (r=8, α=8, q/k/v/o)."""
        name = decoder if isinstance(decoder, str) else getattr(decoder.config, "_name_or_path", "") or ""
        if isinstance(decoder, str):
            decoder = load_decoder(decoder, quantization)
        else:
            _check_quantization(quantization)
        lora_options = dict(LORA_DEFAULTS, **lora) if isinstance(lora, dict) else (dict(LORA_DEFAULTS) if lora else None)
        config = TapmConfig(
            decoder_name=name, text_config=decoder.config.to_dict(), feature_dims=feature_dims,
            feature_tokens=feature_tokens, encoder_dim=encoder_dim, dropout=dropout,
            start_token_id=start_token_id(tokenizer), eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            lora=lora_options, quantization=quantization,
            save_base_decoder=(quantization is None) if save_base_decoder is None else save_base_decoder,
            backbones=backbones,
        )
        if seed is not None:
            torch.manual_seed(seed)  # the encoder's (and adapters') initialisation
        return cls(config, decoder=decoder)

    # -- freezing -------------------------------------------------------------------------
    def set_stage(self, stage: str) -> None:
        """``"adaptation"``: only the visual encoder trains (decoder frozen);
        ``"downstream"``: the encoder and the decoder (its LoRA adapters only
        when it has them)."""
        if stage not in ("adaptation", "downstream"):
            raise ValueError(f"TAPM: stage must be adaptation or downstream, got {stage!r}")
        for name, param in self.decoder.named_parameters():
            trainable = stage == "downstream" and (not self.config.lora or "lora_" in name)
            param.requires_grad_(trainable and param.dtype.is_floating_point)
        for param in self.visual.parameters():
            param.requires_grad_(True)

    # -- transformers plumbing -----------------------------------------------------------
    def get_input_embeddings(self):
        return self.decoder.get_input_embeddings()

    def get_output_embeddings(self):
        return self.decoder.get_output_embeddings()

    def _init_weights(self, module) -> None:
        # The decoder arrives initialised (pretrained or from its config) and
        # the visual encoder initialises itself (torch defaults).
        return

    def encode(self, features: dict[str, torch.Tensor], image_mask: torch.Tensor):
        """Visual prefixes (B, G, P, H), pooled encodings (B, G, H) and direction
        tokens for a batch of stories (see :class:`VisualEncoder`)."""
        dtype = self.visual.cls.dtype
        features = {k: v.to(device=self.visual.cls.device, dtype=dtype) for k, v in features.items()}
        return self.visual(features, image_mask.to(self.visual.cls.device))

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                visual_prefix: torch.Tensor | None = None, past_key_values=None, labels=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if visual_prefix is not None:
            P = visual_prefix.shape[1]
            inputs_embeds = torch.cat((visual_prefix.to(inputs_embeds.dtype), inputs_embeds[:, P:]), dim=1)
        return self.decoder(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                            past_key_values=past_key_values, labels=labels, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, visual_prefix=None, is_first_iteration=False, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, is_first_iteration=is_first_iteration, **kwargs)
        # The prefix is in the KV cache after the first step.
        if is_first_iteration or not kwargs.get("use_cache", True):
            inputs["visual_prefix"] = visual_prefix
        return inputs

    # -- generation -------------------------------------------------------------------------
    def prompt(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` for sentences after ``prefix``
        (N, P, H): P placeholders, then the start token."""
        N, P = prefix.shape[:2]
        ids = torch.full((N, P + 1), self.config.start_token_id, dtype=torch.long, device=prefix.device)
        return ids, torch.ones_like(ids)

    @torch.no_grad()
    def generate_sentences(self, features: dict[str, torch.Tensor], image_mask: torch.Tensor,
                           max_new_tokens: int = 30, **generate_kwargs) -> list[list[list[int]]]:
        """Greedy token ids of one sentence per real image: ``[story][image]``."""
        prefix, _, _ = self.encode(features, image_mask)
        mask = image_mask.bool().cpu()
        flat = prefix[image_mask.bool().to(prefix.device)]  # N P H, story-major order
        ids, attention = self.prompt(flat)
        out = self.generate(input_ids=ids, attention_mask=attention, visual_prefix=flat,
                            max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                            eos_token_id=self.config.eos_token_id, pad_token_id=self.config.pad_token_id,
                            **generate_kwargs)
        new = out[:, ids.shape[1]:].tolist()
        stories, k = [], 0
        for row in mask:
            sentences = []
            for present in row.tolist():
                if present:
                    tokens = new[k]
                    k += 1
                    if self.config.eos_token_id in tokens:
                        tokens = tokens[: tokens.index(self.config.eos_token_id)]
                    sentences.append(tokens)
            stories.append(sentences)
        return stories

    # -- saving and loading -------------------------------------------------------------------
    def save_pretrained(self, save_directory, state_dict: dict | None = None, **kwargs) -> None:
        """``config.json`` and ``model.safetensors``: every weight, or with
        ``save_base_decoder=False`` the encoder and adapters only."""
        from safetensors.torch import save_file

        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        state = state_dict if state_dict is not None else self.state_dict()
        if not self.config.save_base_decoder:
            state = {k: v for k, v in state.items() if not _is_base_decoder_key(k)}
        seen: set = set()
        tensors = {}
        for key, value in state.items():
            # Tied weights (GPT-2's lm_head = wte) are stored once and re-tied on load.
            ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            if ident in seen:
                continue
            seen.add(ident)
            tensors[key] = value.detach().to("cpu").contiguous()
        save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, **kwargs) -> "TapmModel":
        """Rebuild a saved TAPM (a local directory). The base decoder comes from
        the saved weights, or, for ``save_base_decoder=False``, from
        ``config.decoder_name`` (quantised as saved)."""
        from safetensors.torch import load_file

        directory = Path(pretrained_model_name_or_path)
        config_path, weights = directory / "config.json", directory / WEIGHTS
        if not config_path.is_file() or not weights.is_file():
            raise FileNotFoundError(f"{directory}: not a TAPM model directory (needs config.json and {WEIGHTS})")
        kind = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
        if kind != TapmConfig.model_type:
            raise ValueError(f"{directory}: config.json has model_type {kind!r}, not {TapmConfig.model_type!r}")
        config = TapmConfig.from_pretrained(directory)
        decoder = None if config.save_base_decoder else load_decoder(
            config.decoder_name, config.quantization, dtype,
            hint=f"{directory} was saved without its base decoder (save_base_decoder=false), which comes from the hub")
        model = cls(config, decoder=decoder)
        state = load_file(str(weights))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight") or k.endswith("embed_out.weight")}
        bad = [k for k in missing if k not in tied and not (not config.save_base_decoder and _is_base_decoder_key(k))]
        if bad or unexpected:
            raise ValueError(f"{weights}: weights do not match the config (missing {bad[:3]}, "
                             f"unexpected {list(unexpected)[:3]})")
        if tied:
            base = model.decoder.get_base_model() if hasattr(model.decoder, "get_base_model") else model.decoder
            base.tie_weights()
        if dtype is not None and config.quantization is None:
            model.to(dtype)
        if device is not None:
            model.to(device)
        model.eval()
        return model
