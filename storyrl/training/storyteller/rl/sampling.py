"""Rollouts sampled on merged LoRA weights (issue 32): :func:`merged_adapters`.

peft's unmerged LoRA layer runs, per layer and decoding step, the base
linear, dropout, ``lora_A``, ``lora_B``, a scale and an add (plus its Python
dispatch); sampling one token is a forward through every one of them.
Measured on the CPU (benchmarks/README.md, RL-step section) it made the RL
generation phase ~1.3x ``generate`` on the same weights merged. While
sampling, each mergeable LoRA layer is therefore replaced in its parent by
its own base linear holding ``base + delta`` (one extra copy of the adapted
weights, computed in fp32 and rounded once to the weights' dtype), and put
back afterwards with the base weights' original tensors: bit for bit what
they were (peft's own merge/unmerge adds and subtracts in place, which
rounds in bf16/fp16, so the frozen base would drift a little every step).
The adapter's dropout is not applied while sampling (as on merged weights,
and as TRL's vLLM path samples); the log-probabilities the trainers compute
afterwards run on the unmerged model as before.

A layer that cannot be merged exactly this way (a quantised base:
bitsandbytes 4-bit/8-bit, a LoRA variant such as DoRA, ``lora_bias``,
DeepSpeed ZeRO-3 / FSDP shards, an adapter already merged or disabled) makes
the whole model sample unmerged, with one log line saying why.

:func:`kept_base_weights` is the same guarantee for code that merges in
place itself (TRL's vLLM weight sync): the base weights it touches are
copies, the originals come back afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["kept_base_weights", "lora_layers", "merged_adapters", "unmergeable"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def lora_layers(model) -> list[tuple[Any, str, Any]]:
    """``(parent, attribute, layer)`` of every peft LoRA layer in ``model``
    (any module tree: a peft model, a TAPM model with a peft decoder)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no adapters
        return []
    found = []
    for _, parent in model.named_modules():
        for attribute, child in parent.named_children():
            if isinstance(child, LoraLayer):
                found.append((parent, attribute, child))
    return found


def unmergeable(layer) -> str | None:
    """Why ``layer`` (a peft LoRA layer) cannot be merged exactly by
    :func:`merged_adapters`; None when it can."""
    import torch
    from peft.tuners.lora.layer import Linear

    base = layer.get_base_layer()
    if type(layer) is not Linear or type(base) is not torch.nn.Linear:
        # bitsandbytes' Linear4bit/Linear8bitLt subclass nn.Linear: their weights are packed
        return f"{type(base).__name__} base ({type(layer).__name__} adapter layer)"
    if layer.disable_adapters or layer.merged:
        return "adapters disabled or already merged"
    weight = base.weight
    if not weight.is_floating_point() or type(weight.data) is not torch.Tensor or hasattr(weight, "ds_id") \
            or weight.numel() != base.in_features * base.out_features:
        return "sharded or non-float base weights (DeepSpeed ZeRO-3, FSDP)"
    for adapter in _active(layer):
        if adapter in getattr(layer, "lora_variant", {}):
            return f"a LoRA variant ({type(layer.lora_variant[adapter]).__name__}, e.g. DoRA)"
        if getattr(layer, "lora_bias", {}).get(adapter):
            return "lora_bias"
    return None


def _active(layer) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


@contextmanager
def merged_adapters(model, enabled: bool = True) -> Iterator[bool]:
    """While inside, ``model`` samples on merged weights (module docs);
    yields whether it did (False: unchanged, no LoRA layer, ``enabled``
    false, or a layer that cannot be merged). On exit, even after an error,
    every LoRA layer is back in its parent and every base weight is the
    tensor it was."""
    import torch

    layers = lora_layers(model) if enabled else []
    reasons = [r for _, _, layer in layers if (r := unmergeable(layer))]
    if not layers or reasons:
        if reasons and reasons[0] not in _warned:
            _warned.add(reasons[0])
            logger.info("rollouts sample through unmerged LoRA adapters: %s", reasons[0])
        yield False
        return
    swapped: list[tuple[Any, str, Any, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for parent, attribute, layer in layers:
                base = layer.get_base_layer()
                original = base.weight.data
                merged = original.float()
                for adapter in _active(layer):
                    merged = merged + layer.get_delta_weight(adapter).float()
                base.weight.data = merged.to(original.dtype)
                swapped.append((parent, attribute, layer, original))
                setattr(parent, attribute, base)
        yield True
    finally:
        for parent, attribute, layer, original in reversed(swapped):
            layer.get_base_layer().weight.data = original
            setattr(parent, attribute, layer)


@contextmanager
def kept_base_weights(model) -> Iterator[int]:
    """While inside, the base weights (and biases) of ``model``'s LoRA layers
    are copies: whatever merges into them in place (peft's
    ``merge_adapter``/``unmerge_adapter``, which round in bf16/fp16) or
    replaces them (peft's bitsandbytes merge makes new parameters) is undone
    on exit, when every base layer gets its original parameters and tensors
    back. Yields how many layers it guards; sharded weights (ZeRO-3, FSDP:
    empty or distributed tensors, gathered by the caller) are left alone."""
    import torch

    saved = []
    for _, _, layer in lora_layers(model):
        base = layer.get_base_layer()
        params = {name: p for name, p in (("weight", base.weight), ("bias", getattr(base, "bias", None)))
                  if isinstance(p, torch.nn.Parameter) and type(p.data) is torch.Tensor and p.numel() > 0
                  and not hasattr(p, "ds_id")}
        if "weight" not in params:
            continue
        saved.append((base, {name: (p, p.data) for name, p in params.items()}))
        for p in params.values():
            p.data = p.data.clone()
    try:
        yield len(saved)
    finally:
        for base, params in saved:
            for name, (param, data) in params.items():
                param.data = data
                if getattr(base, name) is not param:
                    setattr(base, name, param)
