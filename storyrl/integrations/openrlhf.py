"""storyrl rewards for OpenRLHF: a ``reward_func`` file and the remote
reward protocol shared with ``storyrl serve``.

OpenRLHF's ``--remote_rm_url`` takes either an HTTP endpoint or a Python file
defining ``reward_func(queries, prompts, labels, **kwargs)``. For the file,
pass this module's file (``python -c "import storyrl.integrations.openrlhf
as m; print(m.__file__)"``) with the config in ``STORYRL_REWARD_CONFIG``, or
write a one-line file of your own::

    from storyrl.integrations.openrlhf import reward_func  # noqa: F401

and add ``--label_key`` naming the dataset column with the human story (or
a mapping with the story's context, below). The function returns what recent
OpenRLHF versions take: ``{"rewards": tensor, "scores": tensor,
"extra_logs": {name: tensor}}`` -- ``rewards`` for the advantages,
``scores`` (the same values) for dynamic filtering, ``extra_logs`` (the
reward's per-sample components and ``unscorable``) for the trainer's logs.

OpenRLHF runs ``reward_func`` as Ray tasks: each Ray worker process builds
the reward once (models included) and keeps it, on the resources of a Ray
task (a CPU unless configured otherwise). For a model-based reward, one
``storyrl serve`` on a GPU serving every node is usually the better choice.

The HTTP protocol (``storyrl serve``): POST ``/get_reward`` with
``{"query": [...], "prompts": [...], "labels": [...]}`` (``prompts`` and
``labels`` optional, each as long as ``query``); the answer is the same
mapping with lists. Older OpenRLHF versions read only ``rewards``.

Queries: OpenRLHF sends ``query`` = prompt + response decoded *with* special
tokens. The story is the text after the first occurrence of the sample's
prompt (so a BOS token before the prompt does no harm), or the whole query
when the prompt does not occur in it (or no prompt is given); then trailing
end-of-text markers (:data:`END_MARKERS`, e.g. ``</s>``, ``<|im_end|>``) and
whitespace are removed.

Labels: a string is the human story (``reference``); a mapping may hold any
of :data:`storyrl.integrations.CONTEXT_KEYS` (``reference``, ``story_id``,
``images`` / ``story_images``, ``image_ids``, ``noun_phrases``); null is no
context. Unscorable stories get the fallback reward (default 0.0) and
``unscorable`` = 1.0 (see :mod:`storyrl.integrations`).

A ``weighted`` reward normalised per ``batch`` or per ``group`` normalises
over what one reward call sees: one ``reward_func`` call, or, for the
server, the requests batched together (the prompts tell the groups apart).
``none`` and ``range`` give values that do not depend on batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import storyrl.integrations as _core

__all__ = ["END_MARKERS", "remote_reward_response", "reward_func", "split_queries", "story_from_query"]

#: End-of-text / padding markers that a decode with special tokens leaves
#: after a response (LLaMA, GPT-2, ChatML, LLaMA-3, Gemma, Phi).
END_MARKERS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
               "<eos>", "<|end|>", "<pad>", "<|pad|>", "[PAD]", "[SEP]")


def story_from_query(query: str, prompt: str | None = None, end_markers: Sequence[str] = END_MARKERS) -> str:
    """The response part of an OpenRLHF query (prompt + response): the text
    after the first occurrence of ``prompt``, or the whole query when the
    prompt is empty, None or absent; trailing ``end_markers`` and whitespace
    removed."""
    if prompt:
        at = query.find(prompt)
        if at >= 0:
            query = query[at + len(prompt):]
    story = query.rstrip()
    while True:
        marker = next((m for m in end_markers if m and story.endswith(m)), None)
        if marker is None:
            return story.strip()
        story = story[: -len(marker)].rstrip()


def split_queries(queries: Sequence[Any], prompts: Sequence[Any] | None = None,
                  labels: Sequence[Any] | None = None) -> tuple[list[str], list[dict[str, Any]], list[str | None]]:
    """Stories, per-story contexts and prompts of an OpenRLHF batch,
    checked: lists of equal length, queries and prompts strings (TypeError /
    ValueError)."""
    queries = _list(queries, "query")
    n = len(queries)
    prompts = _list(prompts, "prompts", n) if prompts is not None else [None] * n
    labels = _list(labels, "labels", n) if labels is not None else [None] * n
    for name, values in (("query", queries), ("prompts", prompts)):
        for i, value in enumerate(values):
            if not isinstance(value, str) and not (name == "prompts" and value is None):
                raise TypeError(f"{name}[{i}] must be a string, got {type(value).__name__}")
    stories = [story_from_query(q, p) for q, p in zip(queries, prompts)]
    contexts = [_core.label_context(label, f"labels[{i}]") for i, label in enumerate(labels)]
    return stories, contexts, prompts


def remote_reward_response(scored: _core.Scored, fallback: float) -> dict[str, Any]:
    """The remote reward protocol's answer for a scored batch (lists):
    ``rewards`` and ``scores`` (non-finite -> ``fallback``) and
    ``extra_logs`` (components and ``unscorable``, one value per sample)."""
    rewards = scored.rewards(fallback)
    extra = scored.component_values(fallback)
    extra["unscorable"] = [float(u) for u in scored.unscorable]
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": extra}


def reward_func(queries: Sequence[str], prompts: Sequence[str] | None = None, labels: Sequence[Any] | None = None,
                *, storyrl_config: str | None = None, storyrl_fallback: float | None = None,
                **kwargs: Any) -> dict[str, Any]:
    """OpenRLHF's ``reward_func(queries, prompts, labels, **kwargs)``: the
    storyrl reward of each response, as tensors. The config comes from
    ``storyrl_config`` or ``STORYRL_REWARD_CONFIG`` and is loaded once per
    process; keyword arguments OpenRLHF adds are ignored."""
    import torch

    stories, contexts, prompts = split_queries(queries, prompts, labels)
    reward = _core.reward_from_config(storyrl_config)
    fallback = _core.resolve_fallback(storyrl_fallback)
    scored = _core.score_stories(reward, stories, _core.context_columns(contexts), _prompts(prompts))
    answer = remote_reward_response(scored, fallback)
    return {
        "rewards": torch.tensor(answer["rewards"], dtype=torch.float32),
        "scores": torch.tensor(answer["scores"], dtype=torch.float32),
        "extra_logs": {k: torch.tensor(v, dtype=torch.float32) for k, v in answer["extra_logs"].items()},
    }


def _prompts(prompts: list[str | None]) -> list[str | None] | None:
    """The prompts for the reward call (they group the samples of one prompt
    for a reward normalised per group); None when no sample has one."""
    return prompts if any(p is not None for p in prompts) else None


def _list(values: Any, name: str, n: int | None = None) -> list:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list, got {type(values).__name__}")
    values = list(values)
    if n is not None and len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} queries")
    return values
