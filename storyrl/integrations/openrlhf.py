"""storyrl rewards for OpenRLHF: a ``reward_func`` file and the remote
reward protocol shared with ``storyrl serve``.

OpenRLHF takes either an HTTP endpoint or a Python file defining
``reward_func(queries, prompts, labels, **kwargs)``, and a dataset column
holding each prompt's label. The flags changed in v0.10.2 (the tests run
OpenRLHF 0.8.3, 0.10.2 and 0.11.2's own client code):

==============  ========================  =====================
OpenRLHF        reward (file or URL)      label column
==============  ========================  =====================
>= 0.10.2       ``--reward.remote_url``   ``--data.label_key``
0.8.3 -- 0.10.1 ``--remote_rm_url``       ``--label_key``
==============  ========================  =====================

For the file, pass this module's file (``python -c "import
storyrl.integrations.openrlhf as m; print(m.__file__)"``) with the config in
``STORYRL_REWARD_CONFIG``, or a one-line file of your own::

    from storyrl.integrations.openrlhf import reward_func  # noqa: F401

The function returns ``{"rewards": tensor, "scores": tensor, "extra_logs":
{name: tensor}}`` -- ``rewards`` for the advantages, ``scores`` (the same
values) for dynamic filtering, ``extra_logs`` (the reward's per-sample
components and ``unscorable``) for the trainer's logs. OpenRLHF reads such a
mapping from 0.8.3 on; older versions take a bare tensor and are not
supported.

How OpenRLHF calls it: before 0.10.2, in chunks of
``--micro_rollout_batch_size`` samples as Ray tasks; from 0.10.2, once per
sample (file: in a thread; URL: one request per sample), from each vLLM
engine's process, which builds the reward once (models included). For a
model reward, one ``storyrl serve`` on a GPU serving every engine is usually
the better choice. A ``weighted`` reward normalised per ``batch`` or
``group`` would normalise over whatever one call holds (one sample: the
component is lost), so it is refused; OpenRLHF's ``--advantage_estimator
group_norm`` (GRPO) normalises the total per prompt group itself.

The HTTP protocol (``storyrl serve``): POST ``/get_reward`` with
``{"query": [...], "prompts": [...], "labels": [...]}`` (``prompts`` and
``labels`` optional, each as long as ``query``); the answer is the same
mapping with lists.

Queries: OpenRLHF sends ``query`` = prompt + response decoded *with* special
tokens. The story is the text after the first occurrence of the sample's
prompt (so a BOS token before the prompt does no harm), or the whole query
when the prompt does not occur in it (or no prompt is given); then trailing
end-of-text markers (:data:`END_MARKERS`, e.g. ``</s>``, ``<|im_end|>``) and
whitespace are removed.

Labels: a string is the human story (``reference``); a mapping may hold any
of :data:`storyrl.integrations.CONTEXT_KEYS` (``reference``, ``story_id``,
``images`` / ``story_images``, ``image_ids``, ``noun_phrases``); null is no
context. Without a label key OpenRLHF sends ``""`` for every label: an empty
label is no context, and a reward that needs the human story (``bleu``,
``rouge_l``, ``dhm`` without ``human_scores``, a ``weighted`` reward with
one of them) refuses it with an error naming the flag. Unscorable stories
get the fallback reward (default 0.0) and ``unscorable`` = 1.0 (see
:mod:`storyrl.integrations`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import storyrl.integrations.scoring as _core

log = logging.getLogger(__name__)

__all__ = ["END_MARKERS", "check_company", "check_labels", "check_reward", "needs_reference", "remote_reward_response", "reward_func",
           "split_queries", "story_from_query"]

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
    return _core.strip_end_markers(query, end_markers)


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
    # "" is what OpenRLHF sends without a label key: no context, not an empty human story.
    contexts = [_core.label_context(None if label == "" else label, f"labels[{i}]") for i, label in enumerate(labels)]
    return stories, contexts, prompts


def check_reward(reward: Any) -> None:
    """Refuse a reward whose values depend on which stories are scored
    together (ValueError): OpenRLHF's calls hold one sample (>= 0.10.2) or
    a micro-batch, never a prompt's group."""
    if _core.batch_normalized(reward):
        raise ValueError(
            f"reward {reward.name!r} normalises over the batch or prompt groups, but OpenRLHF scores one sample per "
            "call (a micro-batch before 0.10.2), so that component would be lost: use normalize: range or none, and "
            "OpenRLHF's --advantage_estimator group_norm to normalise the total per prompt group")


def check_company(reward: Any, contexts: Sequence[Mapping[str, Any]], prompts: Sequence[str | None]) -> None:
    """For a reward normalised per batch or group, scored one request at a
    time (``storyrl serve``): refuse a request holding fewer than two stories
    (batch) or a group of one (stories told apart by prompt and ``story_id``,
    as the ``weighted`` reward groups them), whose z-score would be 0 and the
    component lost (ValueError)."""
    if not _core.batch_normalized(reward):
        return
    from storyrl.rewards.composite import prompt_key

    given = any(p is not None for p in prompts)
    keys = [(prompt_key(p) if given else None, c.get("story_id")) for p, c in zip(prompts, contexts)]
    sizes = Counter(keys)
    if len(keys) < 2 or any(sizes[k] < 2 for k in keys):
        raise ValueError(
            f"reward {reward.name!r} normalises over the batch or prompt groups, and this request holds "
            f"{len(keys)} stories in {len(sizes)} group(s), some of one story: send each prompt's samples in one "
            "request (OpenRLHF >= 0.10.2 sends one per request: use normalize: range or none there, with "
            "--advantage_estimator group_norm)")


def check_labels(reward: Any, contexts: Sequence[Mapping[str, Any]]) -> None:
    """Refuse samples without the human story when ``reward`` needs it
    (ValueError naming OpenRLHF's label flag): scoring them would give every
    story the fallback."""
    need = needs_reference(reward)
    if need is None:
        return
    missing = [i for i, c in enumerate(contexts) if not any(c.get(k) for k in need)]
    if missing:
        raise ValueError(
            f"reward {reward.name!r} needs each sample's {' or '.join(need)}, and {len(missing)} of {len(contexts)} "
            f"labels have none (first: labels[{missing[0]}]); OpenRLHF sends '' without a label column: pass "
            "--data.label_key COLUMN (--label_key before 0.10.2) naming the column with the human story or a "
            "mapping with its context")


def needs_reference(reward: Any) -> tuple[str, ...] | None:
    """The context keys of which ``reward`` needs one per story to score
    at all (the human story, or for ``dhm`` with a ``human_scores`` table its
    ``story_id``), or None: ``bleu``/``rouge_l``, ``dhm``, and composites
    with such a component (with a non-zero weight)."""
    from storyrl.rewards.dhm import DHM
    from storyrl.rewards.reference_based import ReferenceReward

    if isinstance(reward, ReferenceReward):
        return ("reference",)  # storyrl passes the single human story as 'reference'
    if isinstance(reward, DHM):
        return ("reference", "story_id") if reward.args.human_scores else ("reference",)
    terms = getattr(reward, "terms", {})
    for name, component in getattr(reward, "component_rewards", {}).items():
        term = terms.get(name)
        if term is not None and term.weight == 0:
            continue
        need = needs_reference(component)
        if need is not None:
            return need
    return None


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

    try:
        stories, contexts, prompts = split_queries(queries, prompts, labels)
        reward = _core.reward_from_config(storyrl_config)
        check_reward(reward)
        check_labels(reward, contexts)
        fallback = _core.resolve_fallback(storyrl_fallback)
    except (TypeError, ValueError) as exc:
        # OpenRLHF >= 0.10.2 logs a failed reward call at INFO only: say it where it is seen.
        log.error("storyrl reward_func: %s", exc)
        raise
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
