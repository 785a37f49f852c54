"""TRL's vLLM generation for GRPO/RLOO, checked when the RL config is read.

``grpo:``/``rloo:`` take TRL 1.16's own keys unchanged (``use_vllm``,
``vllm_mode``, ``vllm_gpu_memory_utilization``, ...; their types are
checked with every TRL key by :mod:`storyrl.training.storyteller.rl.config`). TRL
itself checks almost none of them before the trainer starts (a wrong
``vllm_mode`` fails after the policy is loaded; an unknown server after a
240 s wait), so :func:`vllm_problems` refuses here, one message per fault:

* ``use_vllm: true`` where vLLM is not installed (found without importing
  it), or without a CUDA device (vLLM samples on GPUs);
* values out of range: ``vllm_mode`` (colocate | server),
  ``vllm_model_impl`` (vllm | transformers), ports (1-65535), timeouts,
  ``vllm_gpu_memory_utilization`` in (0, 1], sizes >= 1, a context
  (``vllm_max_model_length``) that cannot hold ``max_completion_length``,
  GRPO's importance-sampling mode and bounds;
* keys TRL would ignore without a word: any ``vllm_*`` key without
  ``use_vllm: true``; server keys (host, port, base URL, timeout, group
  port) in colocate mode and colocate keys (memory share, tensor
  parallelism, context, sleep mode) in server mode; host/port next to a
  base URL (which wins); ``cache_implementation`` with vLLM (transformers'
  cache, unused by vLLM);
* ``load_in_4bit`` with vLLM: TRL has vLLM quantise the policy itself
  (bitsandbytes, in flight) while its weight sync merges the LoRA adapters
  into the NF4 base and back at every step, a lossy round trip.

With LoRA, TRL's weight sync merges the adapters into the base weights in
place and subtracts them again; in bf16/fp16 that rounds, so the frozen base
would drift a little at every step. :func:`storyrl.training.storyteller.rl.sampling.kept_base_weights`
wraps the sync so that the base comes back bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["COLOCATE_KEYS", "SERVER_KEYS", "cuda_available", "vllm_installed", "vllm_problems"]

MODES = ("colocate", "server")
MODEL_IMPLS = ("vllm", "transformers")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SERVER_KEYS = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
               "vllm_group_port")
COLOCATE_KEYS = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length",
                 "vllm_enable_sleep_mode")


def vllm_installed() -> bool:
    """Whether the ``vllm`` package can be imported (found, not imported:
    importing it takes seconds and initialises CUDA)."""
    from importlib.util import find_spec

    try:
        return find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_problems(section: str, given: Mapping[str, Any], built: Any, load_in_4bit: bool = False) -> list[str]:
    """The vLLM faults of one ``grpo``/``rloo`` section (module docs):
    ``given`` the keys the file set, ``built`` TRL's config made from them."""
    vllm_keys = [k for k in given if k.startswith("vllm_")]
    if not getattr(built, "use_vllm", False):
        return [f"{section}.{k}: has no effect without use_vllm: true; set use_vllm: true or remove it"
                for k in vllm_keys]
    if not vllm_installed():  # alone: the rest would not run anyway
        return [f"{section}.use_vllm: vLLM is not installed (pip install -e \".[vllm]\", on a CUDA machine); "
                "or remove use_vllm to sample with transformers' generate"]
    problems = _values(section, built)
    mode = built.vllm_mode
    if mode in MODES:
        unused = SERVER_KEYS if mode == "colocate" else COLOCATE_KEYS
        problems += [f"{section}.{k}: applies to vllm_mode {'server' if mode == 'colocate' else 'colocate'} "
                     f"only; vllm_mode is {mode}" for k in unused if k in given]
    if mode == "server" and "vllm_server_base_url" in given:
        problems += [f"{section}.{k}: vllm_server_base_url is given and wins; remove {k}"
                     for k in ("vllm_server_host", "vllm_server_port") if k in given]
    if "cache_implementation" in given:
        problems.append(f"{section}.cache_implementation: transformers' KV cache; vLLM manages its own (remove "
                        "it, or use_vllm: false)")
    if load_in_4bit:
        problems.append(f"load_in_4bit with {section}.use_vllm: vLLM would quantise the policy itself while TRL's "
                        "weight sync merges the LoRA adapters into the NF4 weights and back at every step (lossy); "
                        "use a bf16/fp16 base with vLLM, or sample 4-bit policies without use_vllm")
    if not cuda_available():
        problems.append(f"{section}.use_vllm: no CUDA device; vLLM samples on GPUs (use_vllm: false samples with "
                        "transformers' generate, here too)")
    return problems


def _values(section: str, c: Any) -> list[str]:
    problems = []

    def bad(key: str, why: str) -> None:
        problems.append(f"{section}.{key}: {why}, got {getattr(c, key)!r}")

    if c.vllm_mode not in MODES:
        bad("vllm_mode", "colocate (vLLM in the training process) or server (a `trl vllm-serve` process)")
    if c.vllm_model_impl not in MODEL_IMPLS:
        bad("vllm_model_impl", "vllm or transformers")
    for key in ("vllm_server_port", "vllm_group_port"):
        if not 1 <= getattr(c, key) <= 65535:
            bad(key, "a port number, 1-65535")
    if not c.vllm_server_timeout > 0:
        bad("vllm_server_timeout", "seconds > 0")
    if not c.vllm_server_host:
        bad("vllm_server_host", "a host name or address")
    url = c.vllm_server_base_url
    if url is not None and not (url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0):
        bad("vllm_server_base_url", "an http:// or https:// URL")
    if not 0 < c.vllm_gpu_memory_utilization <= 1:
        bad("vllm_gpu_memory_utilization", "a share of the GPU's memory in (0, 1]")
    if c.vllm_tensor_parallel_size < 1:
        bad("vllm_tensor_parallel_size", "GPUs per vLLM engine, >= 1")
    length = c.vllm_max_model_length
    if length is not None and length <= c.max_completion_length:
        bad("vllm_max_model_length", f"a context longer than max_completion_length ({c.max_completion_length}) "
            "plus the prompt")
    if c.vllm_structured_outputs_regex is not None and not c.vllm_structured_outputs_regex:
        bad("vllm_structured_outputs_regex", "a regular expression (or null)")
    if hasattr(c, "vllm_importance_sampling_mode"):  # GRPO's
        if c.vllm_importance_sampling_mode not in IS_MODES:
            bad("vllm_importance_sampling_mode", " | ".join(IS_MODES))
        for key in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
            value = getattr(c, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                bad(key, "a ratio bound > 0 (or null)")
    return problems
