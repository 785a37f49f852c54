"""PPO on accelerate with storyrl rewards (TRL 1.16 has no PPO trainer).

One step of :class:`PPOTrainer`:

1. rollout: ``per_device_train_batch_size`` prompts per process, sampled
   from the policy (:mod:`storyrl.training.rl.rollout`), each response cut
   after its first stop token;
2. one no-grad pass for the policy's log-probabilities and values and one
   for the frozen reference's log-probabilities;
3. rewards: every reward function is called TRL-style (``prompts=``,
   ``completions=``, ``completion_ids=``, ``log_metric=``, ``log_extra=``,
   ``trainer_state=None`` and every dataset column but ``prompt``); the score
   is their weighted sum; a sample for which a (non-zero-weighted) function
   returns None/NaN, or raises, is *masked*: it takes no part in the losses,
   the whitening or the score statistics, and is counted in
   ``ppo/masked_frac``. A function that fails for every sample of a step is
   an error;
4. score processing (TRL v0.11 order): ``missing_eos_penalty`` per sequence
   without the stop token, then running-moments scaling (``use_score_scaling``,
   ``use_score_norm``) and clipping (``score_clip``);
5. per-token rewards ``−kl_coef·KL`` (k1 or k3) with the score at the last
   real token, optional reward whitening, GAE (γ, λ), returns = advantages +
   values, whitened advantages (:mod:`storyrl.training.rl.ppo_math`);
6. ``num_ppo_epochs`` passes over shuffled minibatches of stories, each
   accumulated over ``gradient_accumulation_steps`` micro-batches: clipped
   policy loss + ``vf_coef`` × clipped value loss, gradient clipping, AdamW,
   linear or constant learning rate; with ``early_stopping`` a minibatch whose
   approximate KL to the rollout policy exceeds 1.5 × ``target_kl`` is not
   applied and ends the step's PPO epochs (TRL v0.11's rule, checked per
   minibatch and agreed across processes);
7. the adaptive KL controller (``adaptive_kl``) updates ``kl_coef`` from the
   step's mean sequence KL.

TAPM policies: a story is one sentence per image, each sampled independently
after its own visual prefix, so each sentence is its own sequence. The
sentences do not condition on one another (TAPM generates them in parallel
from the images), so the story is one joint action rather than a sequence of
dependent ones: each sentence receives the story's score at its own last
token and GAE runs within the sentence. Giving the score to the last
sentence only would leave the others with no learning signal but the KL
penalty (GAE does not cross sequences, and chaining it across independent
sentences would credit a sentence with choices it cannot influence).

Differences from TRL's removed PPO trainers (v0.11 ``PPOTrainer`` and
``trl.experimental.ppo.PPOTrainer``):

* rewards are Python reward functions with TRL's GRPO contract (storyrl
  rewards as they are), several of them weighted, not a reward model; their
  components are logged through ``log_metric``;
* an unscorable sample (None/NaN, or a reward that raises for it) is masked
  from the losses instead of crashing or poisoning the batch;
* policies: causal LMs, vision-language models (images re-fed in every
  forward) and storyrl's TAPM (one sequence per sentence), each with LoRA
  (reference = adapters disabled, no second copy) or a frozen copy;
* the critic is a value head on the policy (one forward for logits and
  values) or a separate sequence-classification model;
* the score goes to the last real response token (the later trainer put it
  on the token after, the first padding position, and trained a value there);
  the approximate KL and clip fractions are means over real tokens only;
* ``per_device_train_batch_size`` counts prompts per rollout (TRL's was the
  micro-batch; see :mod:`storyrl.training.rl.ppo_config`);
* v0.11's adaptive KL controller, score scaling/clipping and early stopping
  are back, together with the later trainer's k1/k3 estimators, stop-token
  truncation and missing-EOS penalty;
* checkpoints hold the controller's coefficient, the running score moments,
  the history and every RNG, and the data order follows from the step alone,
  so a resumed run equals an uninterrupted one.

Output directory: ``checkpoint-<step>/`` (accelerate's state +
``trainer_state.json``), ``history.jsonl`` (one record per logged step, with
sample stories) and the trackers' files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import storyrl  # noqa: F401  (CPU-only torchvision fallback before accelerate/transformers)

import torch

from storyrl.training.rl import monitor
from storyrl.training.rl import ppo_math as pm
from storyrl.training.rl.ppo_config import PPOConfig
from storyrl.training.rl.rollout import Rollout, make_adapter
from storyrl.training.rl.value import PolicyAndValue, ValueHead, check_value_model, load_value_model, save_value_head

__all__ = ["PPOResult", "PPOTrainer", "TRAINER_STATE", "find_latest_checkpoint"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.json"
# Options a resumed run may change without a warning.
_RESUME_MAY_CHANGE = {"max_steps", "total_episodes", "num_train_epochs", "save_steps", "save_total_limit",
                      "logging_steps", "num_sample_stories", "report_to", "output_dir"}


_UPDATE_METRICS = ("policy/entropy", "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value",
                   "val/clipfrac", "val/vpred")


@dataclass
class PPOResult:
    steps: int  # PPO steps done in total (a resumed run counts the earlier ones)
    history: list[dict] = field(default_factory=list)
    output_dir: str = ""


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete ``checkpoint-<step>`` with the highest step, or None."""
    best, best_step = None, -1
    for path in Path(output_dir).glob("checkpoint-*"):
        suffix = path.name[len("checkpoint-"):]
        if suffix.isdigit() and (path / TRAINER_STATE).is_file() and int(suffix) > best_step:
            best, best_step = path, int(suffix)
    return best


def _reward_name(func: Any) -> str:
    return getattr(func, "__name__", None) or getattr(func, "name", None) or type(func).__name__


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _make_accelerator(args: PPOConfig, trackers):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    kwargs = dict(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available(),
                  log_with=trackers or None, project_dir=args.output_dir)
    try:
        return Accelerator(**kwargs)
    except ValueError as exc:
        if "already been initialized" not in str(exc) or not hasattr(AcceleratorState, "_reset_state"):
            raise
    # An earlier Accelerator in this process used other settings (tests,
    # notebooks): reset the accelerator-level state only.
    AcceleratorState._reset_state()
    return Accelerator(**kwargs)


class PPOTrainer:
    """PPO for story generators (see the module docs).

    ``model``: a transformers causal LM or image-text-to-text model (peft
    wrapped or not) or a storyrl ``TapmModel``; ``reward_funcs``: a callable or
    a list of them (storyrl rewards or any TRL-style reward function);
    ``train_dataset``: rows with a ``prompt`` (string or conversational) and
    the context columns the rewards use (``images`` for VLMs, ``image_ids``
    for TAPM); ``processing_class``: the tokenizer or processor (default:
    loaded from the model's name); ``peft_config``: wrap the model with these
    adapters; ``value_model``: a sequence-classification model (or give
    ``args.value_model``; default a value head); ``reward_weights``: one
    weight per function (default 1); ``trackers``: accelerate trackers
    (names or ``GeneralTracker`` objects) instead of ``args.report_to``."""

    def __init__(self, model, reward_funcs, args: PPOConfig, train_dataset, processing_class=None,
                 peft_config=None, value_model=None, reward_weights: Sequence[float] | None = None,
                 trackers=None) -> None:
        from accelerate.utils import set_seed
        from trl.trainer.utils import disable_dropout_in_model

        if not isinstance(args, PPOConfig):
            raise TypeError(f"PPOTrainer: args must be a PPOConfig, got {type(args).__name__}")
        if args.output_dir is None:
            raise ValueError("PPOTrainer: PPOConfig.output_dir is not set")
        self.args = args
        self.output_dir = Path(args.output_dir)
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or not all(callable(f) for f in funcs):
            raise TypeError("PPOTrainer: reward_funcs must be a callable or a non-empty list of callables")
        self.reward_funcs = funcs
        self.reward_names = [_reward_name(f) for f in funcs]
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(funcs):
            raise ValueError(f"PPOTrainer: {len(weights)} reward weights for {len(funcs)} reward functions")
        if not any(weights):
            raise ValueError("PPOTrainer: every reward weight is 0")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        if len(train_dataset) == 0:
            raise ValueError("PPOTrainer: the training dataset is empty")
        self.train_dataset = train_dataset

        self.accelerator = _make_accelerator(args, args.trackers if trackers is None else list(trackers))
        device = self.accelerator.device
        set_seed(args.seed)

        is_tapm = type(model).__name__ == "TapmModel"
        if processing_class is None:
            processing_class = self._load_processing_class(model, is_tapm)
        self.processing_class = processing_class
        if peft_config is not None:
            if is_tapm:
                raise ValueError("PPOTrainer: a TAPM model carries its LoRA adapters in its config "
                                 "(TapmModel.from_decoder(lora=...)); peft_config does not apply")
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        self.adapter = make_adapter(model, processing_class, args)
        disable_dropout_in_model(model)  # log-probabilities must not depend on the pass
        self.ref_model = self.adapter.make_reference(model)
        if self.ref_model is not None:
            self.ref_model.to(device)

        if value_model is None and args.value_model is not None:
            value_model = load_value_model(args.value_model, self.adapter.tokenizer)
        elif value_model is not None:
            check_value_model(value_model, self.adapter.tokenizer)
        if value_model is not None and is_tapm:
            raise ValueError("PPOTrainer: TAPM policies use a value head (a text value model cannot see the "
                             "visual prefix); leave value_model unset")
        value_head = None
        if value_model is None:
            value_head = ValueHead(self.adapter.hidden_size(model))
        else:
            disable_dropout_in_model(value_model)
        if args.gradient_checkpointing:
            self.adapter.enable_gradient_checkpointing(model)
        wrapper = PolicyAndValue(model, self.adapter, value_head=value_head, value_model=value_model).to(device)

        params = [p for p in wrapper.parameters() if p.requires_grad]
        if not params:
            raise ValueError("PPOTrainer: the model has no trainable parameter")
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
        world = self.accelerator.num_processes
        self.global_batch = args.per_device_train_batch_size * world
        if args.max_steps is not None:
            self.num_steps = args.max_steps
        else:
            episodes = args.total_episodes or len(train_dataset) * args.num_train_epochs
            self.num_steps = max(1, math.ceil(episodes / self.global_batch))
        total_updates = self.num_steps * args.num_ppo_epochs * args.num_mini_batches
        if args.lr_scheduler_type == "linear":
            schedule = lambda n: max(0.0, 1.0 - n / total_updates)  # noqa: E731
        else:
            schedule = lambda n: 1.0  # noqa: E731
        # Not prepared: accelerate's scheduler wrapper steps once per process.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        self.model, self.optimizer = self.accelerator.prepare(wrapper, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)

        self.kl_ctl = (pm.AdaptiveKLController(args.kl_coef, args.target, args.horizon) if args.adaptive_kl
                       else pm.FixedKLController(args.kl_coef))
        self.moments = pm.RunningMoments()
        self.step = 0
        self.history: list[dict] = []
        self._orders: dict[int, list[int]] = {}

    # -- construction helpers --------------------------------------------------------
    @staticmethod
    def _load_processing_class(model, is_tapm: bool):
        from transformers import AutoProcessor, AutoTokenizer

        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        if not name:
            raise ValueError("PPOTrainer: give processing_class (the model does not name its directory)")
        return AutoTokenizer.from_pretrained(name) if is_tapm else AutoProcessor.from_pretrained(name)

    @property
    def policy(self):
        """The (unwrapped) policy being trained."""
        return self.accelerator.unwrap_model(self.model).policy

    # -- data order -----------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        # A permutation per pass, seeded by seed and pass: the rows of a step
        # follow from the step number alone (resume needs no loader state).
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.train_dataset), generator=gen).tolist()}
        return self._orders[epoch]

    def _rows(self, step: int) -> list[dict]:
        n, B = len(self.train_dataset), self.args.per_device_train_batch_size
        start = step * self.global_batch + self.accelerator.process_index * B
        rows = []
        for position in range(start, start + B):
            epoch, k = divmod(position, n)
            rows.append(dict(self.train_dataset[self._order(epoch)[k]]))
        return rows

    # -- rewards -----------------------------------------------------------------------------
    def _call_reward(self, func, name: str, kwargs: dict, n: int, counts: dict) -> list:
        try:
            values = list(func(**kwargs))
        except Exception as exc:  # isolate the completion(s) that break the batch
            logger.warning("reward %r raised on a batch (%s: %s); scoring its completions one by one",
                           name, type(exc).__name__, exc)
            values = []
            for i in range(n):
                one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
                try:
                    values.extend(list(func(**one)) or [None])
                except Exception as one_exc:
                    counts[name] += 1
                    values.append(None)
                    last = one_exc
            if counts[name] >= n:
                raise RuntimeError(f"reward {name!r} failed for every completion of the step: "
                                   f"{type(last).__name__}: {last}") from last
        if len(values) != n:
            raise ValueError(f"reward {name!r} returned {len(values)} values for {n} completions")
        return [math.nan if v is None else float(v) for v in values]

    def _rewards(self, rows: list[dict], rollout: Rollout) -> tuple[torch.Tensor, dict, dict, dict]:
        n = rollout.num_stories
        keys = sorted({k for row in rows for k in row} - {"prompt"})
        metrics: dict[str, list[float]] = defaultdict(list)
        extras: dict[str, list] = {}
        kwargs = {k: [row.get(k) for row in rows] for k in keys}
        kwargs.update(prompts=rollout.prompts, completions=rollout.completions,
                      completion_ids=rollout.completion_ids, trainer_state=None,
                      log_metric=lambda name, value: metrics[name].append(float(value)),
                      log_extra=lambda column, values: extras.__setitem__(column, list(values)))
        out = torch.full((n, len(self.reward_funcs)), math.nan)
        errors: dict[str, int] = defaultdict(int)
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_names)):
            out[:, i] = torch.tensor(self._call_reward(func, name, kwargs, n, errors), dtype=torch.float32)
        return out, {k: sum(v) / len(v) for k, v in metrics.items() if v}, extras, dict(errors)

    # -- forward passes -----------------------------------------------------------------------
    def _micro_stories(self) -> int:
        a = self.args
        return a.per_device_train_batch_size // a.num_mini_batches // a.gradient_accumulation_steps

    def _logprobs(self, logits: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(logits.float() / self.args.temperature, response)

    @torch.no_grad()
    def _evaluate(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities and values of the policy, and the reference's
        log-probabilities, at every response token (0 past the end)."""
        N, T = rollout.response.shape
        Q = rollout.query.shape[1]
        logprobs, ref_logprobs, values = (torch.zeros(N, T, device=rollout.response.device) for _ in range(3))
        policy = self.policy
        chunk = self._micro_stories()
        for start in range(0, rollout.num_stories, chunk):
            stories = torch.arange(start, min(start + chunk, rollout.num_stories), device=rollout.response.device)
            seqs, inputs = self.adapter.model_inputs(rollout, stories)
            with self.accelerator.autocast():
                logits, v = self.model(inputs, Q, T)
                ref_logits = self.adapter.reference_forward(policy, self.ref_model, inputs).logits[:, Q - 1 : Q - 1 + T]
            response = rollout.response[seqs]
            logprobs[seqs] = self._logprobs(logits, response)
            ref_logprobs[seqs] = self._logprobs(ref_logits, response)
            values[seqs] = v.float()
        mask = rollout.response_mask()
        return logprobs * mask, ref_logprobs * mask, values * mask

    # -- one PPO step ------------------------------------------------------------------------------
    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor) if self.accelerator.num_processes > 1 else tensor

    def _step(self, step: int) -> tuple[dict[str, float], list[dict]]:
        from trl.models.utils import unwrap_model_for_generation
        from trl.trainer.utils import entropy_from_logits

        args, acc = self.args, self.accelerator
        device = acc.device
        timings: dict[str, float] = {}
        started = time.perf_counter()
        rows = self._rows(step)
        self.model.eval()
        with torch.no_grad(), unwrap_model_for_generation(self.model, acc) as unwrapped:
            rollout = self.adapter.rollout(unwrapped.policy, rows)
        timings["time/generation"] = time.perf_counter() - started
        tick = time.perf_counter()
        old_logprobs, ref_logprobs, values = self._evaluate(rollout)
        timings["time/forward"] = time.perf_counter() - tick
        tick = time.perf_counter()
        per_func, reward_metrics, extras, errors = self._rewards(rows, rollout)
        timings["time/reward"] = time.perf_counter() - tick
        tick = time.perf_counter()

        # -- scores -----------------------------------------------------------------------------
        weights = self.reward_weights
        used = per_func[:, weights != 0]
        valid = ~torch.isnan(used).any(dim=1)
        scores = torch.where(weights != 0, torch.nan_to_num(per_func, nan=0.0), 0.0) @ weights
        raw_scores = scores.clone()
        truncated = torch.zeros(rollout.num_stories)
        truncated.index_add_(0, rollout.story.cpu(), (~rollout.ended).float().cpu())
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * truncated
        if args.use_score_scaling:
            self.moments.update(_gather_valid(acc, scores.to(device), valid.to(device)))
            mean = self.moments.mean if args.use_score_norm else None
            scores = pm.scale_scores(scores, mean=mean, std=self.moments.std, clip=args.score_clip)
        elif args.score_clip is not None:
            scores = pm.scale_scores(scores, clip=args.score_clip)
        scores = torch.where(valid, scores, 0.0).to(device)
        valid = valid.to(device)

        # -- per-token rewards, advantages ----------------------------------------------------
        mask = rollout.response_mask()
        train_mask = mask & valid[rollout.story].unsqueeze(1)
        kl_coef = self.kl_ctl.value
        kl = pm.kl_per_token(old_logprobs, ref_logprobs, args.kl_estimator) * mask
        rewards, non_score = pm.token_rewards(kl, scores[rollout.story], mask, kl_coef)
        if args.whiten_rewards:
            rewards = pm.masked_whiten(rewards, train_mask, shift_mean=False) * mask
        advantages, returns = pm.gae(rewards, values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            advantages = pm.masked_whiten(advantages, train_mask)
        advantages = advantages * train_mask

        # -- optimisation -------------------------------------------------------------------------
        lr = self.scheduler.get_last_lr()[0]  # the step's first update's
        self.model.train()
        Q, T = rollout.query.shape[1], rollout.response.shape[1]
        B = rollout.num_stories
        mb, gas = B // args.num_mini_batches, args.gradient_accumulation_steps
        micro = mb // gas
        has_valid = acc.reduce(train_mask.any().float().reshape(1), reduction="sum").item() > 0 \
            if acc.num_processes > 1 else bool(train_mask.any())
        stats: dict[str, list[float]] = defaultdict(list)
        updates, early_stopped = 0, False
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + 7919 * step + 1)
        for _ in range(args.num_ppo_epochs if has_valid else 0):
            order = torch.randperm(B, generator=gen).to(device)
            for m in range(args.num_mini_batches):
                kls = []
                for k in range(gas):
                    stories = order[m * mb + k * micro : m * mb + (k + 1) * micro]
                    seqs, inputs = self.adapter.model_inputs(rollout, stories)
                    sync = acc.no_sync(self.model) if k < gas - 1 else nullcontext()
                    with sync:
                        with acc.autocast():
                            logits, vpred = self.model(inputs, Q, T)
                        new_logprobs = self._logprobs(logits, rollout.response[seqs])
                        tm = train_mask[seqs]
                        pg_loss, pg_clipfrac, approx_kl = pm.policy_loss(
                            new_logprobs, old_logprobs[seqs], advantages[seqs], tm, args.cliprange)
                        vf_loss, vf_clipfrac = pm.value_loss(vpred, values[seqs], returns[seqs], tm,
                                                             args.cliprange_value)
                        loss = pg_loss + args.vf_coef * vf_loss
                        acc.backward(loss / gas)
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits.float() / args.temperature)
                        stats["policy/entropy"].append(pm.masked_mean(entropy, tm).item())
                        stats["policy/approxkl"].append(approx_kl.item())
                        stats["policy/clipfrac"].append(pg_clipfrac.item())
                        stats["loss/policy"].append(pg_loss.item())
                        stats["loss/value"].append(vf_loss.item())
                        stats["val/clipfrac"].append(vf_clipfrac.item())
                        stats["val/vpred"].append(pm.masked_mean(vpred, tm).item())
                        kls.append(approx_kl.item())
                minibatch_kl = sum(kls) / len(kls)
                if acc.num_processes > 1:
                    minibatch_kl = acc.reduce(torch.tensor([minibatch_kl], device=device), reduction="mean").item()
                if args.early_stopping and minibatch_kl > 1.5 * args.target_kl:
                    self.optimizer.zero_grad(set_to_none=True)
                    early_stopped = True
                    break
                if args.max_grad_norm is not None:
                    acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                updates += 1
            if early_stopped:
                break
        timings["time/optimization"] = time.perf_counter() - tick

        # -- KL controller, metrics ---------------------------------------------------------------
        story_kl = torch.zeros(B, device=device).index_add_(0, rollout.story, kl.sum(dim=1))
        story_non_score = torch.zeros(B, device=device).index_add_(0, rollout.story, non_score.sum(dim=1))
        story_entropy = torch.zeros(B, device=device).index_add_(0, rollout.story, (-old_logprobs * mask).sum(dim=1))
        all_kl = self._gather(story_kl)
        self.kl_ctl.update(float(all_kl.mean()), self.global_batch)

        gathered = self._gather(per_func.to(device))
        all_valid = self._gather(valid.float())
        all_raw = self._gather(raw_scores.to(device))
        metrics: dict[str, float] = {}
        for i, name in enumerate(self.reward_names):
            column = gathered[:, i]
            scored = column[~torch.isnan(column)]
            metrics[f"rewards/{name}/mean"] = scored.mean().item() if scored.numel() else math.nan
            metrics[f"rewards/{name}/std"] = scored.std().item() if scored.numel() > 1 else math.nan
            metrics[f"rewards/{name}/errors"] = float(errors.get(name, 0))
        metrics.update(reward_metrics)
        ok = all_valid.bool()
        metrics["reward"] = all_raw[ok].mean().item() if ok.any() else math.nan
        metrics["ppo/masked_frac"] = 1.0 - all_valid.mean().item()
        metrics["ppo/truncated_frac"] = self._gather((~rollout.ended).float()).mean().item()
        metrics["objective/scores"] = metrics["reward"]
        metrics["objective/kl"] = all_kl.mean().item()
        metrics["objective/kl_coef"] = kl_coef
        metrics["objective/entropy"] = self._gather(story_entropy).mean().item()
        metrics["objective/non_score_reward"] = self._gather(story_non_score).mean().item()
        rlhf = self._gather(scores + story_non_score)
        metrics["objective/rlhf_reward"] = rlhf[ok].mean().item() if ok.any() else math.nan
        for key in _UPDATE_METRICS:  # NaN for a step without an update (every sample masked)
            metrics[key] = sum(stats[key]) / len(stats[key]) if stats[key] else math.nan
        metrics["ppo/updates"] = float(updates)
        metrics["ppo/early_stopped"] = float(early_stopped)
        metrics["lr"] = lr
        metrics["episode"] = float((step + 1) * self.global_batch)
        texts, lengths = rollout.texts, rollout.story_token_lengths()
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            texts, lengths = gather_object(list(texts)), gather_object(list(lengths))
        metrics.update(monitor.story_stats(texts, lengths))
        timings["time/step"] = time.perf_counter() - started
        metrics.update(timings)
        samples = monitor.sample_stories(rollout.texts, [r if v else None for r, v in
                                                         zip(raw_scores.tolist(), valid.tolist())],
                                         k=self.args.num_sample_stories)
        for column, values_ in extras.items():
            for sample, value in zip(samples, values_):
                sample[column] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        return metrics, samples

    # -- training loop -----------------------------------------------------------------------------
    def train(self, resume: bool = False) -> PPOResult:
        """Run PPO up to ``num_steps`` (``max_steps``, ``total_episodes`` or
        passes over the data); ``resume=True`` continues from the newest
        ``checkpoint-<step>`` in ``output_dir``."""
        from tqdm.auto import tqdm

        args, acc = self.args, self.accelerator
        main = acc.is_main_process
        if resume:
            checkpoint = find_latest_checkpoint(self.output_dir)
            if checkpoint is None:
                raise FileNotFoundError(f"resume=True but {self.output_dir} holds no checkpoint-<step>/ "
                                        f"with {TRAINER_STATE}")
            self._load_checkpoint(checkpoint)
        elif main and find_latest_checkpoint(self.output_dir) is not None:
            logger.warning("%s already holds checkpoints; starting afresh (resume=True continues them)",
                           self.output_dir)
        history_path = self.output_dir / "history.jsonl"
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            history_path.write_text("".join(json.dumps(r) + "\n" for r in self.history), encoding="utf-8")
        acc.init_trackers("storyrl-ppo", config={k: v for k, v in args.to_dict().items()
                                                  if isinstance(v, (int, float, str, bool))})
        bar = tqdm(total=self.num_steps, initial=self.step, desc="PPO", disable=not acc.is_local_main_process)
        try:
            while self.step < self.num_steps:
                metrics, samples = self._step(self.step)
                self.step += 1
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['objective/kl']:.3f}",
                                masked=f"{metrics['ppo/masked_frac']:.2f}")
                if self.step % args.logging_steps == 0 or self.step == self.num_steps:
                    record = {"step": self.step, **{k: _finite_or_none(v) for k, v in metrics.items()},
                              "samples": samples}
                    self.history.append(record)
                    acc.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=self.step)
                    if main:
                        with open(history_path, "a", encoding="utf-8") as f:
                            f.write(json.dumps(record) + "\n")
                        logger.info("step %d: reward %.4f, kl %.4f, masked %.2f, policy loss %s, value loss %s",
                                    self.step, metrics["reward"], metrics["objective/kl"],
                                    metrics["ppo/masked_frac"], metrics.get("loss/policy"),
                                    metrics.get("loss/value"))
                        for sample in samples:
                            logger.info("  sample (reward %s): %s", sample["reward"], sample["story"][:300])
                if args.save_steps is not None and (self.step % args.save_steps == 0 or self.step == self.num_steps):
                    self._save_checkpoint()
        finally:
            bar.close()
            acc.end_training()
        return PPOResult(steps=self.step, history=list(self.history), output_dir=str(self.output_dir))

    # -- checkpoints ---------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        acc = self.accelerator
        final = self.output_dir / f"checkpoint-{self.step}"
        tmp = self.output_dir / f"checkpoint-{self.step}.tmp"
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))  # model + value head, optimizer, scheduler, every process's RNG
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {"step": self.step, "kl_coef": self.kl_ctl.value, "moments": self.moments.state_dict(),
                     "history": self.history, "config": self.args.to_dict()}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._rotate_checkpoints()
        acc.wait_for_everyone()

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if limit is None:
            return
        found = sorted((int(p.name.split("-")[1]), p) for p in self.output_dir.glob("checkpoint-*")
                       if p.name.split("-")[1].isdigit())
        for _, path in found[:-limit]:
            shutil.rmtree(path, ignore_errors=True)

    def _load_checkpoint(self, checkpoint: Path) -> None:
        self.accelerator.load_state(str(checkpoint))  # also restores the RNG of the step that follows
        state = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
        self.step = int(state["step"])
        self.kl_ctl.value = float(state["kl_coef"])
        self.moments.load_state_dict(state["moments"])
        self.history = list(state["history"])
        now = self.args.to_dict()
        changed = sorted(k for k, v in state.get("config", {}).items()
                         if k not in _RESUME_MAY_CHANGE and now.get(k, v) != v)
        if changed:
            logger.warning("resuming with changed settings (the checkpoint used other values): %s", ", ".join(changed))
        logger.info("resuming from %s (step %d)", checkpoint, self.step)

    # -- saving the policy ------------------------------------------------------------------------------
    def save_model(self, directory: str | os.PathLike) -> None:
        """The policy (its adapters only for a peft model, else every weight),
        its tokenizer/processor and, with a value head, ``value_head.safetensors``."""
        directory = Path(directory)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            directory.mkdir(parents=True, exist_ok=True)
            unwrapped = self.accelerator.unwrap_model(self.model)
            self.adapter.save(unwrapped.policy, directory)
            if unwrapped.value_head is not None:
                save_value_head(unwrapped.value_head, directory)
        self.accelerator.wait_for_everyone()


def _gather_valid(acc, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The valid scores of every process (equal-size gathers, then filtered)."""
    if acc.num_processes == 1:
        return scores[valid]
    all_scores, all_valid = acc.gather(scores), acc.gather(valid)
    return all_scores[all_valid.bool()]

