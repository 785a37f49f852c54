"""PPO's critic: a value head on the policy, or a separate value model.

* :class:`ValueHead`: a linear layer on the policy's last hidden state
  (TRL's ``AutoModelForCausalLMWithValueHead`` idea, without its dropout;
  initialised as TRL's PPO initialised its critic's score layer, normal with
  std 1/√(hidden+1), bias 0). It lives in :class:`PolicyAndValue`, so
  accelerate's checkpoints save and restore it with the policy; one policy
  forward gives both the logits and the values.
* A separate ``AutoModelForSequenceClassification`` (``num_labels=1``): its
  backbone's per-token hidden states go through its score head, giving a
  value at every position (what TRL's ``get_reward`` did for its value
  model). It must share the policy's vocabulary (it reads the policy's
  token ids).

:class:`PolicyAndValue` is the one module accelerate prepares (one
optimizer, one DDP wrapper): its forward returns the policy's logits and the
values at the response positions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["PolicyAndValue", "ValueHead", "load_value_model", "save_value_head", "value_model_values"]

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    """A scalar value per position from hidden states (..., H) → (...)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=1.0 / math.sqrt(hidden_size + 1))
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def _score_layer(model) -> nn.Module:
    for name in ("score", "classifier"):
        layer = getattr(model, name, None)
        if isinstance(layer, nn.Module):
            return layer
    raise ValueError(f"value model {type(model).__name__}: no score/classifier head to read values from")


def value_model_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token values (N, L) of a sequence-classification model: its
    backbone's last hidden states through its score head."""
    backbone = getattr(model, model.base_model_prefix)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "return_dict": True,
                              "output_hidden_states": True, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = backbone(**kwargs)
    return _score_layer(model)(out.hidden_states[-1]).squeeze(-1)


def load_value_model(name: str, tokenizer=None, dtype: torch.dtype | None = None):
    """``AutoModelForSequenceClassification`` ``name`` with one label; its
    vocabulary must cover the policy's tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from storyrl.models.hub import local_copy_hint, require_hub_model

    require_hub_model(name, what="value model", hint=local_copy_hint("ppo.value_model in the training YAML"))
    kwargs = {"num_labels": 1}
    if dtype is not None:
        kwargs["dtype"] = dtype
    from storyrl.models.pretrained import load_pretrained

    model = load_pretrained(AutoModelForSequenceClassification, name, **kwargs)
    check_value_model(model, tokenizer, name)
    return model


def check_value_model(model, tokenizer, name: str = "value model") -> None:
    if getattr(model.config, "num_labels", 1) != 1:
        raise ValueError(f"{name}: a value model needs num_labels=1, got {model.config.num_labels}")
    _score_layer(model)
    if tokenizer is not None:
        size = model.get_input_embeddings().num_embeddings
        if size < len(tokenizer):
            raise ValueError(f"{name}: its vocabulary ({size} tokens) does not cover the policy's tokenizer "
                             f"({len(tokenizer)}); the value model reads the policy's token ids")


class PolicyAndValue(nn.Module):
    """The policy with its critic (a :class:`ValueHead` or a value model).

    ``forward(inputs, context_length, response_length)`` runs the policy
    through its adapter and returns ``(logits, values)`` at the response
    positions: ``logits[:, t]`` predicts response token t and ``values[:, t]``
    is the value of the state before it (the hidden state at the same
    position), both (n, T, ...)."""

    def __init__(self, policy: nn.Module, adapter, value_head: ValueHead | None = None,
                 value_model: nn.Module | None = None) -> None:
        super().__init__()
        if (value_head is None) == (value_model is None):
            raise ValueError("PolicyAndValue: give exactly one of value_head and value_model")
        self.policy = policy
        self.value_head = value_head
        self.value_model = value_model
        self.adapter = adapter  # not a module: holds the tokenizer and the sampling settings

    @property
    def is_gradient_checkpointing(self) -> bool:
        # Read by trl's unwrap_model_for_generation, which would switch it
        # off around generate(); checkpointing only acts in training mode and
        # rollouts run in eval mode, so there is nothing to switch.
        return False

    def forward(self, inputs: dict[str, Any], context_length: int, response_length: int):
        from storyrl.training.storyteller.rl.ppo.rollout import response_logits

        out = self.adapter.forward(self.policy, inputs, output_hidden_states=self.value_head is not None,
                                   response_length=response_length)
        window = slice(context_length - 1, context_length - 1 + response_length)
        logits = response_logits(out.logits, context_length, response_length)
        if self.value_head is not None:
            values = self.value_head(out.hidden_states[-1][:, window])
        else:
            values = value_model_values(self.value_model, inputs["input_ids"], inputs["attention_mask"],
                                        inputs.get("position_ids"))[:, window]
        return logits, values.float()


def save_value_head(head: ValueHead, directory: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
              str(Path(directory) / VALUE_HEAD_FILE))
