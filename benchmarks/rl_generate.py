"""Plain ``generate`` next to an RL step's generation phase (issue 32), for
benchmarks/rl_step.py and the GPU suite's rl part.

During a run, :class:`GenerateRecorder` records every outermost
``GenerationMixin.generate`` call the trainer makes (PPO's rollout, TRL's
``_generate_single_turn``): the step it belongs to, its inputs (token ids,
attention mask, a VLM's pixel values ...), its generation config, the
decoding steps it made (output width minus prompt width) and its seconds.

Right after each timed step (outside the step's timed phases: PPO's own
laps, the TRL step clock; the machine's load then is the step's),
:meth:`GenerateRecorder.step_done` replays that step's calls with plain
``generate`` on the run's own model, in eval mode, under ``no_grad``, KV
cache on: the same prompts, batch and padding, the same sampling settings
(temperature, top-k, top-p, ... copied from the recorded config), exactly
the decoding steps the RL call made (``max_new_tokens`` = those steps, no
EOS stop: the RL call may end early when every row met EOS; the replay
then ends at the same step). The torch RNG state is restored afterwards,
so the run samples what it would have sampled. Variants:

* ``plain``: a model without LoRA adapters, as it is;
* ``unmerged``: a LoRA model as it is (peft's layers, ``model.generate``);
* ``merged``: the same with every LoRA layer replaced by a plain linear
  holding the merged weights (``storyrl.training.storyteller.rl.sampling.merged_adapters``:
  the module tree then is what ``merge_and_unload`` leaves; the base model's
  own ``generate``), the reference of a LoRA model. Where the adapters
  cannot be merged that way (a 4-bit base), the run's model is merged for
  good with peft's ``merge_and_unload`` after the run instead and replayed
  then (``merged_after_run``: not interleaved).

Each variant is warmed up once (two new tokens) before its first timed
replay; each call is replayed ``repeats`` times per variant, the variants
alternating, and the median taken (summed over a step's calls). The
figures (:func:`summary`): ``generation_over_generate`` = the median over
timed steps of (the step's generation-phase seconds / its reference
replay's seconds), paired step by step (the phase also holds tokenisation,
decoding and whatever the trainer does around ``generate``);
``generate_call_over_generate`` the same for the RL ``generate`` call
alone; ``ms_per_token`` = seconds / (rows x decoding steps).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Any

#: Sampling fields of the RL call's GenerationConfig the replay copies.
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
                   "suppress_tokens", "num_beams", "pad_token_id", "bos_token_id")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class GenerateRecorder:
    """Records a run's outermost ``generate`` calls and replays each timed
    step's calls right after it (module docs). The runner calls
    :meth:`next_step` where a training step starts and :meth:`step_done`
    with the model where it ends."""

    def __init__(self, device: str = "cpu", warmup: int = 0, repeats: int = 3) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.step = -1
        self.calls: list[dict[str, Any]] = []
        self.replays: dict[int, dict[str, float]] = {}
        self._depth = 0
        self._warm: set[str] = set()

    def next_step(self) -> None:
        self.step += 1

    @contextmanager
    def recording(self):
        from transformers.generation.utils import GenerationMixin

        original = GenerationMixin.generate
        recorder = self

        def generate(model, *args, **kwargs):
            if recorder._depth:  # a replay, or generate calling itself
                return original(model, *args, **kwargs)
            recorder._depth += 1
            try:
                _sync(recorder.device)
                t0 = time.perf_counter()
                out = original(model, *args, **kwargs)
                _sync(recorder.device)
                seconds = time.perf_counter() - t0
            finally:
                recorder._depth -= 1
            recorder.calls.append(_record(recorder.step, seconds, args, kwargs, out))
            return out

        GenerationMixin.generate = generate
        try:
            yield self
        finally:
            GenerationMixin.generate = original

    def step_calls(self, step: int) -> list[dict]:
        return [c for c in self.calls if c["step"] == step]

    def step_done(self, model) -> None:
        """Replay the calls of the step that just ended (a timed one)."""
        calls = self.step_calls(self.step)
        if self.step < self.warmup or not calls:
            return
        self._depth += 1  # the replays are not recorded
        try:
            with _kept_rng(self.device):
                self.replays[self.step] = self._replay_variants(model, calls)
        finally:
            self._depth -= 1

    def _replay_variants(self, model, calls: list[dict]) -> dict[str, float]:
        from storyrl.training.storyteller.rl.sampling import lora_layers, merged_adapters

        was_training = model.training
        model.eval()
        try:
            variants = ["unmerged", "merged"] if lora_layers(model) else ["plain"]
            seconds: dict[str, list[list[float]]] = {v: [[] for _ in calls] for v in variants}
            for _ in range(self.repeats):
                for variant in variants:
                    with merged_adapters(model) if variant == "merged" else nullcontext(True) as merged:
                        if not merged:  # cannot be merged by swapping (4-bit): merged after the run
                            seconds.pop(variant, None)
                            continue
                        target = _base(model) if variant == "merged" else model
                        if variant not in self._warm:
                            replay(target, calls[0], new_tokens=2, device=self.device)
                            self._warm.add(variant)
                        for k, call in enumerate(calls):
                            seconds[variant][k].append(replay(target, call, device=self.device))
        finally:
            model.train(was_training)
        return {v: sum(statistics.median(s) for s in per_call) for v, per_call in seconds.items()}

    def merged_after_run(self, model) -> None:
        """For adapters :meth:`step_done` could not merge: merge ``model``
        for good (peft ``merge_and_unload``; the run is over) and replay
        every timed step's calls on it (``merged``, not interleaved)."""
        if not self.replays or any("merged" in r or "plain" in r for r in self.replays.values()):
            return
        if not hasattr(model, "merge_and_unload"):
            return
        merged = model.merge_and_unload().eval()
        self._depth += 1
        try:
            for step, replays in self.replays.items():
                calls = self.step_calls(step)
                if "merged" not in self._warm:
                    replay(merged, calls[0], new_tokens=2, device=self.device)
                    self._warm.add("merged")
                replays["merged"] = sum(statistics.median(replay(merged, c, device=self.device)
                                                          for _ in range(self.repeats)) for c in calls)
                replays["merged_after_run"] = True
        finally:
            self._depth -= 1


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


@contextmanager
def _kept_rng(device: str):
    import torch

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _record(step: int, seconds: float, args, kwargs: dict, out) -> dict[str, Any]:
    import torch

    inputs = dict(kwargs)
    if args:  # generate(input_ids, ...)
        inputs["input_ids"] = args[0]
    config = inputs.pop("generation_config", None)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    ids = inputs["input_ids"]
    tensors = {k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    sampling = {f: getattr(config, f) for f in SAMPLING_FIELDS if config is not None and hasattr(config, f)}
    sampling.update({k: others.pop(k) for k in list(others) if k in SAMPLING_FIELDS})
    return {"step": step, "seconds": seconds, "inputs": tensors, "others": others, "sampling": sampling,
            "rows": int(ids.shape[0]), "prompt_width": int(ids.shape[1]),
            "decoding_steps": int(sequences.shape[1] - ids.shape[1])}


def replay_config(call: dict, new_tokens: int):
    """The plain GenerationConfig of a recorded call (module docs)."""
    from transformers import GenerationConfig

    # eos_token_id []: never stop early, exactly the RL call's decoding steps (None would take the model's EOS).
    return GenerationConfig(**{k: v for k, v in call["sampling"].items() if v is not None},
                            max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=[], use_cache=True)


def replay(model, call: dict, new_tokens: int | None = None, device: str = "cpu") -> float:
    """Seconds of one plain ``generate`` of ``call``'s inputs (module docs)."""
    import torch

    steps = call["decoding_steps"] if new_tokens is None else new_tokens
    config = replay_config(call, steps)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**call["inputs"], **call["others"], generation_config=config)
    _sync(device)
    seconds = time.perf_counter() - t0
    made = out.shape[1] - call["prompt_width"]
    if made != steps:
        raise RuntimeError(f"plain generate made {made} decoding steps, not {steps}")
    return seconds


def summary(recorder: GenerateRecorder, phases: list[float]) -> dict[str, Any]:
    """The figures of a finished run (module docs). ``phases``: the
    generation phase's seconds of each timed step, in order."""
    order = sorted(recorder.replays)[: len(phases)]
    if not order:
        return {"error": "no generate call was recorded in the timed steps"}
    calls = [recorder.step_calls(s) for s in order]
    phases = phases[: len(order)]
    replays = [recorder.replays[s] for s in order]
    variants = [v for v in ("plain", "unmerged", "merged") if v in replays[0]]
    reference = "merged" if "merged" in variants else variants[0]
    tokens = [sum(c["rows"] * c["decoding_steps"] for c in step_calls) for step_calls in calls]
    inner = [sum(c["seconds"] for c in step_calls) for step_calls in calls]
    out: dict[str, Any] = {
        "reference": reference, "steps": len(order), "repeats": recorder.repeats,
        "merged_after_run": bool(replays[0].get("merged_after_run")),
        "rows": [[c["rows"] for c in step_calls] for step_calls in calls],
        "prompt_width": [[c["prompt_width"] for c in step_calls] for step_calls in calls],
        "decoding_steps": [[c["decoding_steps"] for c in step_calls] for step_calls in calls],
        "tokens": tokens, "generation_s": phases, "generate_call_s": inner,
        "sampling": {k: v if isinstance(v, (int, float, str, bool, list)) or v is None else str(v)
                     for k, v in calls[0][0]["sampling"].items()},
        "ms_per_token": {"generation": _per_token(phases, tokens), "generate_call": _per_token(inner, tokens)},
    }
    for name in variants:
        seconds = [r[name] for r in replays]
        out[f"{name}_s"] = seconds
        out["ms_per_token"][name] = _per_token(seconds, tokens)
        suffix = "" if name == reference else f"_{name}"
        out[f"generation_over_generate{suffix}"] = _paired(phases, seconds)
        out[f"generate_call_over_generate{suffix}"] = _paired(inner, seconds)
    if "unmerged" in variants and "merged" in variants:
        out["unmerged_over_merged"] = _paired(out["unmerged_s"], out["merged_s"])
    return out


def _paired(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def _per_token(seconds: list[float], tokens: list[int]) -> float:
    return 1e3 * statistics.median(s / t for s, t in zip(seconds, tokens) if t)
