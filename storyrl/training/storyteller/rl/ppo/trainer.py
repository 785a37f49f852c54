"""PPO on accelerate with storyrl rewards (TRL 1.16 has no PPO trainer).

One step of :class:`PPOTrainer`:

1. rollout: ``per_device_train_batch_size`` prompts per process, sampled
   from the policy (:mod:`storyrl.training.storyteller.rl.ppo.rollout`), each response cut
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
   values, whitened advantages (:mod:`storyrl.training.storyteller.rl.ppo.math`);
6. ``num_ppo_epochs`` passes over shuffled minibatches of stories, each
   accumulated over ``gradient_accumulation_steps`` micro-batches: clipped
   policy loss + ``vf_coef`` × clipped value loss, gradient clipping, AdamW,
   linear or constant learning rate; with ``early_stopping`` a minibatch whose
   approximate KL to the rollout policy exceeds 1.5 × ``target_kl`` is not
   applied and ends the step's PPO epochs (TRL v0.11's threshold; v0.11
   checked after each epoch, on its last minibatch's mean log-ratio, and
   kept that update); the decision is agreed across processes;
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
  micro-batch; see :mod:`storyrl.training.storyteller.rl.ppo.config`);
* v0.11's adaptive KL controller, score scaling/clipping and early stopping
  are back, together with the later trainer's k1/k3 estimators, stop-token
  truncation and missing-EOS penalty;
* checkpoints hold the controller's coefficient, the running score moments,
  the history and every RNG, and the data order follows from the step alone,
  so a resumed run equals an uninterrupted one.

Output directory: ``checkpoint-<step>/`` (accelerate's state +
``trainer_state.json``), ``history.jsonl`` (the scalars of each logged
step), ``samples.jsonl`` (its sample stories with their rewards; both files as
GRPO/RLOO write them) and the trackers' files.

Modules: options :mod:`~storyrl.training.storyteller.rl.ppo.config`, arithmetic
:mod:`~storyrl.training.storyteller.rl.ppo.math`, sampling and forwards per policy kind
:mod:`~storyrl.training.storyteller.rl.ppo.rollout`, critic :mod:`~storyrl.training.storyteller.rl.ppo.value`,
reward calls :mod:`~storyrl.training.storyteller.rl.ppo.rewards`, checkpoints
:mod:`~storyrl.training.storyteller.rl.ppo.checkpoints`; this one holds the loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from storyrl.training.accelerators import make_accelerator
from storyrl.training.checkpoints import load_checkpoint
from storyrl.training.guards import check_finite_weights, check_named_checkpoint
from storyrl.training.storyteller.rl import monitor
from storyrl.training.storyteller.rl.ppo import math as ppo_math
from storyrl.training.storyteller.rl.ppo.checkpoints import (
    RESUME_MAY_CHANGE,
    TRAINER_STATE,
    find_latest_checkpoint,
    save_checkpoint,
)
from storyrl.training.storyteller.rl.ppo.config import PPOConfig
from storyrl.training.storyteller.rl.ppo.rewards import call_rewards, combine_scores, reward_name
from storyrl.training.storyteller.rl.ppo.rollout import Rollout, is_tapm_policy, make_adapter, response_logits
from storyrl.training.storyteller.rl.ppo.value import (
    PolicyAndValue,
    ValueHead,
    check_value_model,
    load_value_model,
    save_value_head,
)
from storyrl.training.runs import RunFailedError

__all__ = ["PPOResult", "PPOTrainer", "TRAINER_STATE", "find_latest_checkpoint"]

logger = logging.getLogger(__name__)

# Metrics of the optimisation; NaN for a step without an update (every sample masked).
_UPDATE_METRICS = ("policy/entropy", "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value",
                   "val/clipfrac", "val/vpred")


@dataclass
class PPOResult:
    steps: int  # PPO steps done in total (a resumed run counts the earlier ones)
    history: list[dict] = field(default_factory=list)
    output_dir: str = ""

    def summary(self) -> dict[str, Any]:
        """Steps, the output directory and the last logged reward (as RLResult's)."""
        return {"output_dir": self.output_dir, "steps": self.steps, "last_reward": monitor.last_reward(self.history)}


@dataclass
class _Batch:
    """What the optimisation of one step needs, per response token (N, T)."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    train_mask: torch.Tensor  # real tokens of scorable stories


def data_order_seed(seed: int, epoch: int) -> int:
    """The seed of the permutation of the dataset for pass ``epoch`` over it."""
    return seed * 1_000_003 + epoch


def minibatch_order_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s minibatch shuffles (one generator for all its PPO epochs)."""
    return seed * 1_000_003 + 7919 * step + 1


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
    (names or ``GeneralTracker`` objects) instead of ``args.report_to``.

    After construction: ``policy`` (the unwrapped policy), ``ref_model`` (the
    frozen reference; None when it is the policy with its adapters
    disabled), ``adapter``, ``kl_ctl`` (``.value`` is the KL coefficient),
    ``moments`` (running score statistics), ``num_steps``."""

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
        self.reward_names = [reward_name(f) for f in funcs]
        weights = [1.0] * len(funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(weights) != len(funcs):
            raise ValueError(f"PPOTrainer: {len(weights)} reward weights for {len(funcs)} reward functions")
        if not any(weights):
            raise ValueError("PPOTrainer: every reward weight is 0")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        if len(train_dataset) == 0:
            raise ValueError("PPOTrainer: the training dataset is empty")
        self.train_dataset = train_dataset

        trackers = args.trackers if trackers is None else list(trackers)
        self.accelerator = make_accelerator(args.mixed_precision, log_with=trackers or None,
                                            project_dir=args.output_dir)
        device = self.accelerator.device
        set_seed(args.seed)

        is_tapm = is_tapm_policy(model)
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
            # In the policy's dtype (a bf16 7B policy beside an fp32 7B critic would not fit where the policy
            # does), but never fp16: the critic trains all its weights (an fp16 base trains through LoRA only).
            dtype = getattr(model, "dtype", None)
            dtype = torch.float32 if dtype in (None, torch.float16) or not dtype.is_floating_point else dtype
            value_model = load_value_model(args.value_model, self.adapter.tokenizer, dtype=dtype)
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
        self.global_batch = args.per_device_train_batch_size * self.accelerator.num_processes
        # Stories per minibatch and per micro-batch (one forward/backward) of a process's rollout.
        self.minibatch_stories = args.per_device_train_batch_size // args.num_mini_batches
        self.micro_stories = self.minibatch_stories // args.gradient_accumulation_steps
        if args.max_steps is not None:
            self.num_steps = args.max_steps
        else:
            episodes = args.total_episodes or len(train_dataset) * args.num_train_epochs
            self.num_steps = max(1, math.ceil(episodes / self.global_batch))
        total_updates = self.num_steps * args.num_ppo_epochs * args.num_mini_batches
        linear = args.lr_scheduler_type == "linear"
        # Not prepared: accelerate's scheduler wrapper steps once per process.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: max(0.0, 1.0 - n / total_updates) if linear else 1.0)
        # The schedule's state goes to trainer_state.json (JSON), not to
        # accelerate's custom_checkpoint_*.pkl, which resume would unpickle.
        self.model, self.optimizer = self.accelerator.prepare(wrapper, optimizer)

        self.kl_ctl = (ppo_math.AdaptiveKLController(args.kl_coef, args.target, args.horizon) if args.adaptive_kl
                       else ppo_math.FixedKLController(args.kl_coef))
        self.moments = ppo_math.RunningMoments()
        self.step = 0
        self.history: list[dict] = []
        self._orders: dict[int, list[int]] = {}

    @staticmethod
    def _load_processing_class(model, is_tapm: bool):
        from transformers import AutoProcessor, AutoTokenizer

        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        if not name:
            raise ValueError("PPOTrainer: give processing_class (the model does not name its directory)")
        from storyrl.models.hub import require_hub_model

        require_hub_model(name, what="policy's tokenizer/processor", hint="give PPOTrainer its processing_class")
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
            gen = torch.Generator().manual_seed(data_order_seed(self.args.seed, epoch))
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

    # -- forward passes -----------------------------------------------------------------------
    def _tempered(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the distribution the rollouts sample from: divided
        by the temperature, suppressed tokens (a VLM's image placeholders)
        excluded (a large negative value rather than -inf keeps the entropy
        finite)."""
        logits = logits.float() / self.args.temperature
        suppressed = self.adapter.suppressed
        if suppressed:
            index = torch.tensor(suppressed, device=logits.device)
            logits = logits.index_fill(-1, index, torch.finfo(logits.dtype).min)
        return logits

    def _logprobs(self, logits: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax(self._tempered(logits), response)

    @torch.no_grad()
    def _evaluate(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities and values of the policy, and the reference's
        log-probabilities, at every response token (0 past the end)."""
        N, T = rollout.response.shape
        Q = rollout.query.shape[1]
        device = rollout.response.device
        logprobs, ref_logprobs, values = (torch.zeros(N, T, device=device) for _ in range(3))
        chunk = self.micro_stories
        for start in range(0, rollout.num_stories, chunk):
            stories = torch.arange(start, min(start + chunk, rollout.num_stories), device=device)
            seqs, inputs = self.adapter.model_inputs(rollout, stories)
            with self.accelerator.autocast():
                logits, v = self.model(inputs, Q, T)
                ref_out = self.adapter.reference_forward(self.policy, self.ref_model, inputs, T)
            response = rollout.response[seqs]
            logprobs[seqs] = self._logprobs(logits, response)
            ref_logprobs[seqs] = self._logprobs(response_logits(ref_out.logits, Q, T), response)
            values[seqs] = v.float()
        mask = rollout.response_mask()
        return logprobs * mask, ref_logprobs * mask, values * mask

    def _check_finite(self, step: int, rollout: Rollout, *tensors: torch.Tensor) -> None:
        """Stop at NaN/inf log-probabilities or values (an fp16 overflow, a
        broken checkpoint): every loss would be NaN, and on CUDA sampling from
        NaN probabilities does not raise as on the CPU but yields token 0 (a
        story of padding). Agreed across processes, so that all stop."""
        mask = rollout.response_mask()
        bad = torch.tensor([float(not torch.isfinite(t[mask]).all()) for t in tensors], device=mask.device)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad.to(self.accelerator.device), reduction="sum")
        names = [n for n, b in zip(("policy log-probabilities", "reference log-probabilities", "values"),
                                   bad.tolist()) if b]
        if names:
            dtype = getattr(self.policy, "dtype", None)
            raise RunFailedError(f"step {step + 1}: the {', '.join(names)} are NaN/inf (weights "
                                 f"{str(dtype).replace('torch.', '')}, mixed_precision {self.args.mixed_precision}; "
                                 "an fp16 overflow? try bf16 or fp32)")

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(tensor) if self.accelerator.num_processes > 1 else tensor

    # -- one PPO step ------------------------------------------------------------------------------
    def _scores(self, raw: torch.Tensor, valid: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """Story scores after the missing-EOS penalty (per sequence without
        the stop token), running-moments scaling and clipping; 0 for
        unscorable stories."""
        args = self.args
        scores = raw.clone()
        if args.missing_eos_penalty is not None:
            truncated = rollout.per_story((~rollout.ended).float().cpu())
            scores = scores - args.missing_eos_penalty * truncated
        if args.use_score_scaling:
            self.moments.update(self._gather_valid(scores, valid))
            mean = self.moments.mean if args.use_score_norm else None
            scores = ppo_math.scale_scores(scores, mean=mean, std=self.moments.std, clip=args.score_clip)
        elif args.score_clip is not None:
            scores = ppo_math.scale_scores(scores, clip=args.score_clip)
        return torch.where(valid, scores, 0.0)

    def _gather_valid(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The valid scores of every process (equal-size gathers, then filtered)."""
        if self.accelerator.num_processes == 1:
            return scores[valid]
        device = self.accelerator.device
        all_scores, all_valid = self.accelerator.gather(scores.to(device)), self.accelerator.gather(valid.to(device))
        return all_scores[all_valid.bool()]

    def _advantages(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor, old_logprobs, ref_logprobs,
                    values) -> tuple[_Batch, torch.Tensor, torch.Tensor, float]:
        """Per-token KL and rewards, GAE, whitening. Returns the batch, the
        KL and non-score rewards per token and the KL coefficient used."""
        args = self.args
        mask = rollout.response_mask()
        train_mask = mask & valid[rollout.story].unsqueeze(1)
        kl_coef = self.kl_ctl.value
        kl = ppo_math.kl_per_token(old_logprobs, ref_logprobs, args.kl_estimator) * mask
        rewards, non_score = ppo_math.token_rewards(kl, scores[rollout.story], mask, kl_coef)
        if args.whiten_rewards:
            rewards = ppo_math.masked_whiten(rewards, train_mask, shift_mean=False) * mask
        advantages, returns = ppo_math.gae(rewards, values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            advantages = ppo_math.masked_whiten(advantages, train_mask)
        batch = _Batch(rollout, old_logprobs, values, advantages * train_mask, returns, train_mask)
        return batch, kl, non_score, kl_coef

    def _update(self, batch: _Batch, step: int) -> tuple[dict[str, list[float]], int, bool]:
        """``num_ppo_epochs`` passes of minibatch updates. Returns the
        per-micro-batch statistics, the optimizer steps taken and whether
        early stopping ended the passes."""
        from trl.trainer.utils import entropy_from_logits

        args, accelerator = self.args, self.accelerator
        rollout = batch.rollout
        stats: dict[str, list[float]] = defaultdict(list)
        has_valid = batch.train_mask.any().float().reshape(1)
        if accelerator.num_processes > 1:
            has_valid = accelerator.reduce(has_valid, reduction="sum")
        if not has_valid.item():
            return stats, 0, False
        self.model.train()
        Q, T = rollout.query.shape[1], rollout.response.shape[1]
        accumulation, minibatch, micro = args.gradient_accumulation_steps, self.minibatch_stories, self.micro_stories
        updates = 0
        gen = torch.Generator().manual_seed(minibatch_order_seed(args.seed, step))
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(rollout.num_stories, generator=gen).to(accelerator.device)
            for m in range(args.num_mini_batches):
                kls = []
                for k in range(accumulation):
                    stories = order[m * minibatch + k * micro : m * minibatch + (k + 1) * micro]
                    seqs, inputs = self.adapter.model_inputs(rollout, stories)
                    token_mask = batch.train_mask[seqs]
                    with accelerator.no_sync(self.model) if k < accumulation - 1 else nullcontext():
                        with accelerator.autocast():
                            logits, vpred = self.model(inputs, Q, T)
                        new_logprobs = self._logprobs(logits, rollout.response[seqs])
                        pg_loss, pg_clipfrac, approx_kl = ppo_math.policy_loss(
                            new_logprobs, batch.old_logprobs[seqs], batch.advantages[seqs], token_mask, args.cliprange)
                        vf_loss, vf_clipfrac = ppo_math.value_loss(vpred, batch.values[seqs], batch.returns[seqs],
                                                                   token_mask, args.cliprange_value)
                        accelerator.backward((pg_loss + args.vf_coef * vf_loss) / accumulation)
                    with torch.no_grad():
                        entropy = entropy_from_logits(self._tempered(logits))
                        for key, value in (("policy/entropy", ppo_math.masked_mean(entropy, token_mask)),
                                           ("policy/approxkl", approx_kl), ("policy/clipfrac", pg_clipfrac),
                                           ("loss/policy", pg_loss), ("loss/value", vf_loss),
                                           ("val/clipfrac", vf_clipfrac),
                                           ("val/vpred", ppo_math.masked_mean(vpred, token_mask))):
                            stats[key].append(float(value))
                    kls.append(float(approx_kl))
                minibatch_kl = sum(kls) / len(kls)
                if accelerator.num_processes > 1:  # every process takes the same decision
                    minibatch_kl = accelerator.reduce(torch.tensor([minibatch_kl], device=accelerator.device),
                                                      "mean").item()
                if args.early_stopping and minibatch_kl > 1.5 * args.target_kl:
                    self.optimizer.zero_grad(set_to_none=True)  # this minibatch's update is not applied
                    return stats, updates, True
                if args.max_grad_norm is not None:
                    accelerator.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                updates += 1
        return stats, updates, False

    def _step(self, step: int) -> tuple[dict[str, float], list[dict]]:
        from trl.models.utils import unwrap_model_for_generation

        device = self.accelerator.device
        timings: dict[str, float] = {}
        started = tick = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.perf_counter()
            timings[name], tick = now - tick, now

        rows = self._rows(step)
        self.model.eval()
        with torch.no_grad(), unwrap_model_for_generation(self.model, self.accelerator) as unwrapped:
            rollout = self.adapter.rollout(unwrapped.policy, rows)
        lap("time/generation")
        old_logprobs, ref_logprobs, values = self._evaluate(rollout)
        self._check_finite(step, rollout, old_logprobs, ref_logprobs, values)
        lap("time/forward")
        rewards = call_rewards(self.reward_funcs, self.reward_names, rows, rollout.prompts, rollout.completions,
                               rollout.completion_ids)
        lap("time/reward")
        raw, valid = combine_scores(rewards.values, self.reward_weights)
        scores = self._scores(raw, valid, rollout).to(device)
        batch, kl, non_score, kl_coef = self._advantages(rollout, scores, valid.to(device), old_logprobs,
                                                         ref_logprobs, values)
        lr = self.scheduler.get_last_lr()[0]  # that of the step's first update
        update = self._update(batch, step)
        lap("time/optimization")

        story_kl = self._gather(rollout.per_story(kl))
        self.kl_ctl.update(float(story_kl.mean()), self.global_batch)
        metrics = self._metrics(step, rollout, rewards, raw, valid, scores, story_kl, non_score, old_logprobs,
                                kl_coef, lr, update)
        metrics.update(self._story_stats(rollout))
        timings["time/step"] = time.perf_counter() - started
        metrics.update(timings)
        return metrics, self._samples(rollout, rewards, raw, valid)

    def _metrics(self, step: int, rollout: Rollout, rewards, raw: torch.Tensor, valid: torch.Tensor,
                 scores: torch.Tensor, story_kl: torch.Tensor, non_score: torch.Tensor, old_logprobs: torch.Tensor,
                 kl_coef: float, lr: float, update: tuple[dict[str, list[float]], int, bool]) -> dict[str, float]:
        """The step's reward, objective and update figures over every
        process's stories (each collective in the same order on every
        process); ``update`` is what :meth:`_update` returned."""
        stats, updates, early_stopped = update
        device = self.accelerator.device
        metrics: dict[str, float] = {}
        values_all = self._gather(rewards.values.to(device))
        for i, name in enumerate(self.reward_names):
            scored = values_all[:, i][~torch.isnan(values_all[:, i])]
            metrics[f"rewards/{name}/mean"] = scored.mean().item() if scored.numel() else math.nan
            metrics[f"rewards/{name}/std"] = scored.std().item() if scored.numel() > 1 else math.nan
            metrics[f"rewards/{name}/errors"] = float(rewards.errors.get(name, 0))
        metrics.update(rewards.metrics)
        ok = self._gather(valid.to(device).float()).bool()
        raw_all = self._gather(raw.to(device))
        story_non_score = rollout.per_story(non_score)
        rlhf = self._gather(scores + story_non_score)
        metrics.update({
            "reward": raw_all[ok].mean().item() if ok.any() else math.nan,
            "ppo/masked_frac": 1.0 - ok.float().mean().item(),
            "ppo/truncated_frac": self._gather((~rollout.ended).float()).mean().item(),
            "objective/kl": story_kl.mean().item(),
            "objective/kl_coef": kl_coef,
            "objective/entropy": self._gather(rollout.per_story(-old_logprobs)).mean().item(),
            "objective/non_score_reward": self._gather(story_non_score).mean().item(),
            "objective/rlhf_reward": rlhf[ok].mean().item() if ok.any() else math.nan,
            "ppo/updates": float(updates),
            "ppo/early_stopped": float(early_stopped),
            "lr": lr,
            "episode": float((step + 1) * self.global_batch),
        })
        metrics["objective/scores"] = metrics["reward"]
        for key in _UPDATE_METRICS:
            metrics[key] = sum(stats[key]) / len(stats[key]) if stats[key] else math.nan
        return metrics

    def _unscorable_reason(self, metrics: dict[str, float]) -> str:
        """Why a step scored no story, naming only the rewards at fault. A
        story counts only when every non-zero-weighted reward scores it
        (:func:`combine_scores`), so a reward that scored every story can sit
        beside one that scored none; naming both (as this message once did)
        hid which one to fix, e.g. a random policy's word soup that ``dhm``
        cannot score beside a finite ``bleu``."""
        weighted = [n for n, w in zip(self.reward_names, self.reward_weights.tolist()) if w != 0]
        none = [n for n in weighted if not math.isfinite(metrics.get(f"rewards/{n}/mean", math.nan))]
        fix = "check what the rewards need (references, images, models)"
        if none == weighted:
            return f"{', '.join(none)} returned None/NaN for every completion (nothing to learn from); {fix}"
        scored = [n for n in weighted if n not in none]
        if none:
            return (f"{', '.join(none)} returned None/NaN for every completion, and PPO scores a story only when "
                    f"every reward with a non-zero weight scores it ({', '.join(scored)} did score; unlike "
                    f"GRPO/RLOO, which sum the rewards that scored); {fix}, or give {', '.join(none)} weight 0 to "
                    "log it only")
        return (f"every reward scored some stories but none scored all of {', '.join(weighted)} (PPO scores a "
                f"story only when every reward with a non-zero weight scores it); {fix}")

    def _story_stats(self, rollout: Rollout) -> dict[str, float]:
        """Length and diversity of every process's stories (monitor.story_stats)."""
        texts, lengths = rollout.texts, rollout.story_token_lengths()
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            texts, lengths = gather_object(list(texts)), gather_object(list(lengths))
        return monitor.story_stats(texts, lengths)

    def _samples(self, rollout: Rollout, rewards, raw: torch.Tensor, valid: torch.Tensor) -> list[dict]:
        """This process's sample stories with their scores and the rewards' logged columns."""
        shown = [r if v else None for r, v in zip(raw.tolist(), valid.tolist())]
        samples = monitor.sample_stories(rollout.texts, shown, k=self.args.num_sample_stories)
        for column, column_values in rewards.extras.items():
            for sample, value in zip(samples, column_values):
                sample[column] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        return samples

    # -- training loop -----------------------------------------------------------------------------
    def train(self, resume: bool = False, progress: bool = True) -> PPOResult:
        """Run PPO up to ``num_steps`` (``max_steps``, ``total_episodes`` or
        passes over the data); ``resume=True`` continues from the newest
        ``checkpoint-<step>`` in ``output_dir``; ``progress=False`` hides the
        progress bar (the log lines stay)."""
        from storyrl.console import progress as progress_bar

        args, accelerator = self.args, self.accelerator
        main = accelerator.is_main_process
        if resume:
            checkpoint = find_latest_checkpoint(self.output_dir)
            if checkpoint is None:
                raise FileNotFoundError(f"resume=True but {self.output_dir} holds no checkpoint-<step>/ "
                                        f"with {TRAINER_STATE}")
            # Its step is its name's and within this run (a planted or another run's checkpoint is refused).
            check_named_checkpoint(checkpoint, "step", self.num_steps)
            state = load_checkpoint(accelerator, checkpoint, args.to_dict(), RESUME_MAY_CHANGE)  # and the next step's RNG
            logger.info("resuming from %s (step %d)", checkpoint, state["step"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step = int(state["step"])
            self.kl_ctl.value = float(state["kl_coef"])
            self.moments.load_state_dict(state["moments"])
            self.history = list(state["history"])
        elif main and find_latest_checkpoint(self.output_dir) is not None:
            logger.warning("%s already holds checkpoints; starting afresh (resume=True continues them)",
                           self.output_dir)
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # Rewritten from the checkpoint: drops records of steps after it.
            for name, lines in _log_lines(self.history).items():
                (self.output_dir / name).write_text("".join(lines), encoding="utf-8")
        accelerator.init_trackers("storyrl-ppo", config={k: v for k, v in args.to_dict().items()
                                                          if isinstance(v, (int, float, str, bool))})
        bar = progress_bar(total=self.num_steps, initial=self.step, desc="PPO",
                           disable=not (progress and accelerator.is_local_main_process))
        scored = any(isinstance(r.get("reward"), (int, float)) for r in self.history)  # before a resume
        try:
            while self.step < self.num_steps:
                metrics, samples = self._step(self.step)
                self.step += 1
                # Before anything is logged or saved: NaN/inf weights (a diverged update) stop the run.
                check_finite_weights(self.model, f"step {self.step}")
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", kl=f"{metrics['objective/kl']:.3f}",
                                masked=f"{metrics['ppo/masked_frac']:.2f}")
                failed = not scored and not math.isfinite(metrics["reward"])  # over every process's stories
                scored = scored or math.isfinite(metrics["reward"])
                if failed or self.step % args.logging_steps == 0 or self.step == self.num_steps:
                    self._log(metrics, samples)
                if failed:  # every process stops here, before a checkpoint of the untrained policy
                    raise RunFailedError(f"step {self.step}: no story was scorable: {self._unscorable_reason(metrics)}")
                if not math.isfinite(metrics["reward"]):
                    logger.warning("step %d: no story was scorable; the step made no update", self.step)
                if args.save_steps is not None and (self.step % args.save_steps == 0 or self.step == self.num_steps):
                    state = {"step": self.step, "kl_coef": self.kl_ctl.value, "moments": self.moments.state_dict(),
                             "scheduler": self.scheduler.state_dict(), "history": self.history,
                             "config": args.to_dict()}
                    save_checkpoint(accelerator, self.output_dir, self.step, state, keep=args.save_total_limit)
        finally:
            bar.close()
            # Not accelerator.end_training(): it also destroys the process group, and
            # save_model() after train() still synchronises the processes.
            for tracker in accelerator.trackers:
                tracker.finish()
        return PPOResult(steps=self.step, history=list(self.history), output_dir=str(self.output_dir))

    def _log(self, metrics: dict[str, float], samples: list[dict]) -> None:
        """history.jsonl (scalars), samples.jsonl (sample stories), as GRPO and
        RLOO write them; the trackers (scalars) and the console."""
        record = {"step": self.step, **{k: monitor.finite_or_none(v) for k, v in metrics.items()}, "samples": samples}
        self.history.append(record)
        self.accelerator.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=self.step)
        if not self.accelerator.is_main_process:
            return
        for name, lines in _log_lines([record]).items():
            with open(self.output_dir / name, "a", encoding="utf-8") as f:
                f.writelines(lines)
        logger.info("step %d: reward %.4f, kl %.4f, masked %.2f, policy loss %.4f, value loss %.4f", self.step,
                    metrics["reward"], metrics["objective/kl"], metrics["ppo/masked_frac"], metrics["loss/policy"],
                    metrics["loss/value"])
        for sample in samples:
            logger.info("  sample (reward %s): %s", sample["reward"], sample["story"][:300])

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


def _log_lines(records: list[dict]) -> dict[str, list[str]]:
    """The lines of history.jsonl and samples.jsonl for in-memory records
    (which keep their samples, for the result and the checkpoint)."""
    return {
        "history.jsonl": [json.dumps({k: v for k, v in r.items() if k != "samples"}) + "\n" for r in records],
        "samples.jsonl": [json.dumps({"step": r["step"], "samples": r["samples"]}) + "\n" for r in records],
    }
