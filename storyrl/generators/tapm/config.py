"""The TAPM model's transformers config (``model_type = "storyrl_tapm"``)."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

__all__ = ["LORA_DEFAULTS", "TapmConfig"]

#: The d_HM paper's +LLaMA 2 adapters: r=8, alpha=8 on the attention projections.
LORA_DEFAULTS: dict[str, Any] = {"r": 8, "lora_alpha": 8, "lora_dropout": 0.05,
                                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


class TapmConfig(PretrainedConfig):
    """Everything needed to rebuild a TAPM model without its training config.

    ``feature_dims`` maps each visual feature type (``"image"``, ``"boxes"``)
    to its input width, in the order the prefix lists them; ``feature_tokens``
    gives the tokens per image of each type (1 for whole-image features, the
    box count for regions). ``text_config`` is the decoder's config (the
    base decoder is ``decoder_name``); ``lora`` the peft
    ``LoraConfig`` keywords or None; ``quantization`` ``"4bit"`` or None;
    ``save_base_decoder`` False stores only the encoder and the adapters (the
    base decoder is reloaded by name, as for a 4-bit LLaMA-2)."""

    model_type = "storyrl_tapm"
    sub_configs = {"text_config": AutoConfig}

    def __init__(
        self,
        decoder_name: str = "gpt2",
        text_config: dict | PretrainedConfig | None = None,
        feature_dims: dict[str, int] | None = None,
        feature_tokens: dict[str, int] | None = None,
        encoder_dim: int | None = None,
        num_residual_blocks: int = 3,
        neighbours: tuple[int, ...] | list[int] = (-2, -1, 1, 2),
        dropout: float = 0.5,
        start_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        lora: dict[str, Any] | None = None,
        quantization: str | None = None,
        save_base_decoder: bool = True,
        backbones: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(text_config, dict):
            kind = text_config.get("model_type")
            if kind is None:
                raise ValueError("TapmConfig: text_config lacks 'model_type'")
            text_config = AutoConfig.for_model(**text_config)
        self.text_config = text_config
        self.decoder_name = decoder_name
        self.feature_dims = dict(feature_dims or {"image": 2048})
        self.feature_tokens = dict(feature_tokens or {k: 1 for k in self.feature_dims})
        self.encoder_dim = encoder_dim
        self.num_residual_blocks = num_residual_blocks
        self.neighbours = [int(k) for k in neighbours]
        self.dropout = dropout
        self.start_token_id = start_token_id
        self.lora = dict(lora) if lora else None
        self.quantization = quantization
        self.save_base_decoder = save_base_decoder
        # The feature extractors the features were made with (storyrl features),
        # so that generation can compute missing features the same way.
        self.backbones = dict(backbones or {})
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size if self.text_config is not None else 768

    @property
    def width(self) -> int:
        """The visual encoder's width (the decoder's hidden size unless set)."""
        return self.encoder_dim or self.hidden_size

    def prefix_length(self) -> int:
        """``[cls] type1 [sep] type2 [sep] ...``: each type contributes a global
        token, one per neighbour direction and its own tokens."""
        per_type = [1 + len(self.neighbours) + self.feature_tokens[k] for k in self.feature_dims]
        return 1 + sum(n + 1 for n in per_type)


# Lets AutoConfig (and AutoTokenizer, which reads config.json) recognise TAPM directories.
AutoConfig.register(TapmConfig.model_type, TapmConfig, exist_ok=True)
