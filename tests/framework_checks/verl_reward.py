"""Runs storyrl's verl adapter inside verl's own reward code, in a process
whose path holds a released verl wheel (see tests/frameworks.py).

Reads a JSON job on stdin (or ``{"jobs": [...]}``: each in turn, in this
process), prints one JSON line. Modes:

* ``loop`` (verl >= 0.7.1): verl's config composed by Hydra from verl's own
  YAML with the given overrides (plus ``migrate_legacy_reward_impl`` where
  ``migrate`` is set, as verl 0.7.1-0.8.x's main_ppo does), then verl's
  ``RewardLoopManager.compute_rm_score`` over a ``DataProto`` -- its workers
  (``RewardLoopWorker``: verl's reward loader, reward manager and per-sample
  gathering) run in this process: only Ray's remote call is replaced by a
  direct call on the worker's event loop. With ``gdpo`` verl's
  ``compute_gdpo_outcome_advantage`` runs on the result.
* ``legacy`` (verl <= 0.7.0): verl's ``load_reward_manager`` with the legacy
  keys and the manager's ``__call__(data, return_dict=True)``.
* ``resolve``: what verl's loader makes of the overrides (the custom function
  found or None; the reward manager class or the error).
"""

from __future__ import annotations

import json
import os
import sys

import storyrl  # noqa: F401  (installs the torchvision hook before verl imports transformers)


def compose(overrides):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    directory = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=directory, version_base=None):
        return hydra_compose("ppo_trainer", overrides=list(overrides))


def data_proto(job, tokenizer):
    import numpy as np
    import torch
    from verl import DataProto

    samples = job["samples"]
    prompt_len, response_len = 4, job.get("response_length", 48)
    pad = tokenizer.pad_token_id
    prompts, responses, masks = [], [], []
    for sample in samples:
        ids = tokenizer(sample["story"], add_special_tokens=False)["input_ids"][:response_len]
        prompts.append([pad] * prompt_len)
        responses.append(ids + [pad] * (response_len - len(ids)))
        masks.append([1] * prompt_len + [1] * len(ids) + [0] * (response_len - len(ids)))
    batch = {
        "prompts": torch.tensor(prompts), "responses": torch.tensor(responses),
        "attention_mask": torch.tensor(masks), "input_ids": torch.cat([torch.tensor(prompts),
                                                                      torch.tensor(responses)], 1),
    }
    non_tensor = {
        "data_source": np.array(["storyrl/vist"] * len(samples), dtype=object),
        "reward_model": np.array([{"ground_truth": s.get("ground_truth")} for s in samples], dtype=object),
        "extra_info": np.array([dict(s.get("extra_info") or {}) for s in samples], dtype=object),
        "uid": np.array([s.get("uid", str(i)) for i, s in enumerate(samples)], dtype=object),
    }
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor)


class InProcessWorker:
    """A Ray actor handle stand-in: ``compute_score_batch.remote(chunk)``
    runs the worker's coroutine on the worker's own event loop."""

    def __init__(self, worker):
        self.worker = worker
        self.compute_score_batch = self

    def remote(self, chunk):
        return self.worker.loop.run_until_complete(self.worker.compute_score_batch(chunk))


def run_loop(job):
    import torch
    from verl.experimental.reward_loop import reward_loop
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    config = compose(job["overrides"])
    if job.get("migrate"):
        config = reward_loop.migrate_legacy_reward_impl(config)
    reward_loop.ray.get = lambda refs: list(refs)  # results are already computed in this process
    manager = reward_loop.RewardLoopManager.__new__(reward_loop.RewardLoopManager)
    manager.config = config
    manager.reward_model_manager = None
    manager.reward_router_address = None
    manager.reward_manager_cls = resolve_reward_manager_cls(config)
    workers = [reward_loop.RewardLoopWorker(config, None) for _ in range(config.reward.num_workers)]
    manager.reward_loop_workers = [InProcessWorker(w) for w in workers]
    data = data_proto(job, workers[0].input_tokenizer)
    out = manager.compute_rm_score(data)
    rm = out.batch["rm_scores"]
    result = {
        "scores": rm.sum(-1).tolist(),
        "positions": [int(i) for i in (rm != 0).float().argmax(-1)],
        "extra": {k: [float(v) for v in out.non_tensor_batch[k]] for k in out.meta_info["reward_extra_keys"]},
        "stories": [workers[0].input_tokenizer.decode(r[r != workers[0].input_tokenizer.pad_token_id],
                                                      skip_special_tokens=True) for r in data.batch["responses"]],
        "manager": manager.reward_manager_cls.__name__,
        "lengths": data.batch["attention_mask"][:, data.batch["prompts"].size(1):].sum(-1).tolist(),
    }
    from storyrl.integrations import verl as adapter

    result["batch_sizes"] = sorted(
        size for batchers in adapter._BATCHERS.values() for b in batchers.values() for size in
        b.batch_sizes.elements())
    if job.get("gdpo"):
        from verl.trainer.ppo.core_algos import compute_gdpo_outcome_advantage

        response_mask = data.batch["attention_mask"][:, data.batch["prompts"].size(1):]
        advantages, _ = compute_gdpo_outcome_advantage(
            token_level_rewards=rm, response_mask=response_mask, index=data.non_tensor_batch["uid"],
            config=config.algorithm, non_tensor_batch=out.non_tensor_batch, batch=data.batch)
        result["advantages"] = (advantages * response_mask).sum(-1).div(response_mask.sum(-1)).tolist()
    del torch
    return result


def run_legacy(job):
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils import hf_tokenizer

    config = compose(job["overrides"])
    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    manager = load_reward_manager(config, tokenizer, num_examine=0)
    data = data_proto(job, tokenizer)
    out = manager(data, return_dict=True)
    extra = out.get("reward_extra_info", {})
    return {"scores": out["reward_tensor"].sum(-1).tolist(), "manager": type(manager).__name__,
            "extra": {k: [float(v) for v in values] for k, values in extra.items()}}


def run_resolve(job):
    from verl.trainer.ppo.reward import get_custom_reward_fn, resolve_reward_manager_cls

    config = compose(job["overrides"])
    if job.get("migrate"):
        from verl.experimental.reward_loop import reward_loop

        config = reward_loop.migrate_legacy_reward_impl(config)
    result = {"custom_fn": get_custom_reward_fn(config) is not None}
    try:
        result["manager"] = resolve_reward_manager_cls(config).__name__
    except ValueError as exc:
        result["manager_error"] = str(exc)
    return result


def run_job(job):
    from storyrl.integrations import verl as adapter

    adapter._BATCHERS.clear()  # each job's batch sizes are its own (jobs may share a process)
    mode = {"loop": run_loop, "legacy": run_legacy, "resolve": run_resolve}[job["mode"]]
    try:
        return mode(job)
    except Exception as exc:  # noqa: BLE001  (reported to the test as data)
        return {"error": f"{type(exc).__name__}: {exc}"}


def main():
    import verl

    payload = json.loads(sys.stdin.read())
    if "jobs" in payload:  # several jobs in one process: verl's import is most of a job's time
        print(json.dumps({"results": [run_job(job) for job in payload["jobs"]], "verl": verl.__version__}))
        return
    print(json.dumps({**run_job(payload), "verl": verl.__version__}))


if __name__ == "__main__":
    main()
