"""A plain, independent PPO reference for tests/test_ppo_reference.py.

It replays the rollouts that storyrl's :class:`~storyrl.training.storyteller.rl.ppo.PPOTrainer`
sampled (recorded by :func:`record`) on its own float64 copy of the initial
policy and critic, and recomputes every step of the algorithm that
``storyrl/training/storyteller/rl/ppo/`` documents (TRL v0.11's PPOTrainer order, with
its listed differences) with explicit Python loops over stories, sequences,
tokens, PPO epochs, minibatches and micro-batches:

* forwards: one sequence at a time, unpadded (the query's real tokens, then
  the response's), positions from 0; the critic reads the hidden state
  *before* each response token; a TAPM story's visual prefix comes from its
  own images only; the KL reference is a frozen copy of the *initial* policy
  (LoRA adapters start at B = 0, so that is also the policy with its adapters
  disabled, and TAPM's reference visual encoder is the initial one);
* scores: weighted sum of the reward values, a story unscorable when a
  function with a non-zero weight gave None/NaN (zero-weight functions are
  logged only), the missing-EOS penalty per truncated sequence, running
  moments (Chan et al.) over the scorable stories, scaling/normalisation and
  clipping (TRL v0.11);
* per token: KL (k1 or k3), rewards −kl_coef·KL with the score at the last
  real token, reward whitening (scale only), GAE, returns, advantage
  whitening, both over the real tokens of scorable stories;
* update: the minibatch permutation of each PPO epoch from the trainer's
  documented seed rule, PPO-clip and clipped value losses per micro-batch
  (token means, divided by the accumulation steps), gradient clipping (own
  code), AdamW (``torch.optim.AdamW``, driven by hand: lr set per update,
  linear or constant), early stopping on the minibatch's mean approximate KL
  (> 1.5·target_kl: not applied, gradients dropped, the step's epochs end);
* after the step: the adaptive KL controller (Ziegler et al.) and every
  metric the trainer logs.

Nothing here imports storyrl's PPO modules (ppo_math, rollout, value, ppo).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

DTYPE = torch.float64
_EPS_WHITEN = 1e-8
_EPS_SCALE = torch.finfo(torch.float32).eps  # the scores' dtype (float32) machine epsilon, as TRL v0.11


# -- recording what the trainer sampled ---------------------------------------------------------


@dataclass
class Recording:
    """Per step: the rows given to the rollout, the rollout, and each reward
    function's values (list per function, None/NaN kept). ``micro_batches``:
    the story indices of every micro-batch the trainer's update forwarded,
    per step."""

    rows: list[list[dict]] = field(default_factory=list)
    rollouts: list[Any] = field(default_factory=list)
    reward_calls: list[list[list]] = field(default_factory=list)  # [function][call] -> values
    micro_batches: list[list[list[int]]] = field(default_factory=list)

    def rewards(self, step: int) -> list[list]:
        """(stories, functions) raw values of ``step``."""
        per_function = [calls[step] for calls in self.reward_calls]
        return [list(v) for v in zip(*per_function)]


def record(trainer) -> Recording:
    """Wrap ``trainer.adapter.rollout``, its reward functions and the
    adapter's ``model_inputs`` (update passes only) to record each step."""
    rec = Recording()
    adapter = trainer.adapter
    rollout, model_inputs = adapter.rollout, adapter.model_inputs

    def recording_rollout(policy, rows):
        out = rollout(policy, rows)
        rec.rows.append([dict(r) for r in rows])
        rec.rollouts.append(out)
        rec.micro_batches.append([])
        return out

    def recording_inputs(r, stories):
        if torch.is_grad_enabled():  # the update's forwards (the evaluation runs under no_grad)
            rec.micro_batches[-1].append([int(s) for s in stories.tolist()])
        return model_inputs(r, stories)

    adapter.rollout = recording_rollout
    adapter.model_inputs = recording_inputs
    rec.reward_calls = [[] for _ in trainer.reward_funcs]
    wrapped = []
    for i, func in enumerate(trainer.reward_funcs):
        def call(*args, _func=func, _i=i, **kwargs):
            values = list(_func(*args, **kwargs))
            rec.reward_calls[_i].append(values)
            return values
        wrapped.append(call)
    trainer.reward_funcs = wrapped
    return rec


def initial_copy(trainer) -> nn.Module:
    """The trainer's policy and critic as they are now (before training), in
    a container whose parameter names equal the trainer's wrapper's."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    box = nn.Module()
    box.policy = copy.deepcopy(wrapper.policy)
    if wrapper.value_head is not None:
        box.value_head = copy.deepcopy(wrapper.value_head)
    if wrapper.value_model is not None:
        box.value_model = copy.deepcopy(wrapper.value_model)
    return box


def expected_rows(dataset, seed: int, batch: int, step: int) -> list[dict]:
    """The rows of ``step``: positions step·B … step·B + B − 1 of the
    concatenated passes, pass e shuffled by randperm(seed·1 000 003 + e)."""
    n, rows = len(dataset), []
    for position in range(step * batch, (step + 1) * batch):
        epoch, k = divmod(position, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        rows.append(dict(dataset[perm[k]]))
    return rows


# -- small helpers on plain lists ---------------------------------------------------------------------


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _whiten(values: dict[tuple[int, int], float], keys: list[tuple[int, int]], shift_mean: bool) -> dict:
    """Whiten every entry of ``values`` with the mean and unbiased variance
    of the entries ``keys``; unchanged with fewer than two."""
    if len(keys) < 2:
        return dict(values)
    n = len(keys)
    mean = sum(values[k] for k in keys) / n
    var = sum((values[k] - mean) ** 2 for k in keys) / (n - 1)
    scale = 1.0 / math.sqrt(var + _EPS_WHITEN)
    return {k: (v - mean) * scale + (0.0 if shift_mean else mean) for k, v in values.items()}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


class Moments:
    """Running mean/variance of all scores seen (parallel combination),
    starting at mean 0, var 1, count 1e-24 (TRL v0.11)."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: list[float]) -> None:
        if not xs:
            return
        n = len(xs)
        m = sum(xs) / n
        v = sum((x - m) ** 2 for x in xs) / n
        delta, total = m - self.mean, self.count + n
        m2 = self.var * self.count + v * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        n = self.count
        return math.sqrt(self.var * n / (n - 1)) if n > 1 else math.sqrt(self.var)


# -- the reference ---------------------------------------------------------------------------------


class ReferencePPO:
    """The reference trainer (module docs). ``initial``: :func:`initial_copy`
    of the trainer before ``train()``; ``args``: its PPOConfig;
    ``reward_weights``/``reward_names``: one per function; ``num_steps``: the
    run's steps (for the linear schedule)."""

    def __init__(self, initial: nn.Module, args, reward_weights, reward_names, num_steps: int) -> None:
        self.args = args
        self.model = copy.deepcopy(initial).to(DTYPE)
        self.frozen = copy.deepcopy(initial.policy).to(DTYPE).eval().requires_grad_(False)
        self.model.eval()  # dropout is off in the trainer too
        self.weights = [float(w) for w in reward_weights]
        self.names = list(reward_names)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.learning_rate, weight_decay=args.weight_decay)
        self.kl_coef = float(args.kl_coef)
        self.moments = Moments()
        self.updates = 0  # optimizer steps applied so far
        self.clipped_updates = 0  # of them, those whose gradient norm was clipped
        self.total_updates = num_steps * args.num_ppo_epochs * args.num_mini_batches
        self.history: list[dict[str, float]] = []
        self.micro_batches: list[list[list[int]]] = []

    # -- forwards, one sequence at a time ----------------------------------------------------
    def _outputs(self, policy, rollout, story: int, critic: bool):
        """[(sequence index, logits (L, V), values (L,) or None)] for the
        sequences of ``story``, each run alone and unpadded."""
        seqs = [i for i, s in enumerate(rollout.story.tolist()) if s == story]
        tapm = type(policy).__name__ == "TapmModel"
        if tapm:
            n = len(seqs)
            image_mask = rollout.extra["image_mask"][story]
            assert image_mask[:n].all() and not image_mask[n:].any()
            features = {k: v[story : story + 1, :n].to(DTYPE) for k, v in rollout.extra["features"].items()}
            prefix = policy.visual(features, torch.ones(1, n, dtype=torch.bool))[0][0]  # (n, P, H)
        out = []
        for j, i in enumerate(seqs):
            query = rollout.query[i][rollout.query_mask[i].bool()]
            length = int(rollout.lengths[i])
            ids = torch.cat((query, rollout.response[i, :length])).unsqueeze(0)
            extra = {"visual_prefix": prefix[j : j + 1]} if tapm else {}
            result = policy(input_ids=ids, output_hidden_states=True, use_cache=False, **extra)
            start = len(query) - 1  # the position whose output predicts response token 0
            logits = result.logits[0, start : start + length].to(DTYPE)
            values = None
            if critic and hasattr(self.model, "value_head"):
                values = self.model.value_head(result.hidden_states[-1][0, start : start + length])
            elif critic:
                vm = self.model.value_model
                hidden = getattr(vm, vm.base_model_prefix)(input_ids=ids, use_cache=False).last_hidden_state
                values = vm.score(hidden)[0, start : start + length, 0]
            out.append((i, logits, values))
        return out

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits / self.args.temperature, dim=-1)
        return torch.stack([logp[t, int(tokens[t])] for t in range(logits.shape[0])])

    def _entropies(self, logits: torch.Tensor) -> list[float]:
        logp = torch.log_softmax(logits / self.args.temperature, dim=-1)
        return [float(-(logp[t].exp() * logp[t]).sum()) for t in range(logits.shape[0])]

    # -- one step ---------------------------------------------------------------------------------
    def step(self, step: int, rollout, reward_values: list[list]) -> dict[str, float]:
        a = self.args
        B = rollout.num_stories
        story_of = rollout.story.tolist()
        lengths = rollout.lengths.tolist()
        N = len(lengths)
        response = rollout.response

        # log-probabilities and values at the rollout policy, the reference's log-probabilities
        old, values, ref = {}, {}, {}
        with torch.no_grad():
            for b in range(B):
                for i, logits, v in self._outputs(self.model.policy, rollout, b, critic=True):
                    old[i] = self._logprobs(logits, response[i]).tolist()
                    values[i] = v.tolist()
                for i, logits, _ in self._outputs(self.frozen, rollout, b, critic=False):
                    ref[i] = self._logprobs(logits, response[i]).tolist()

        # scores
        raw, valid = [], []
        for b in range(B):
            total, ok = 0.0, True
            for value, weight in zip(reward_values[b], self.weights):
                if weight == 0:
                    continue  # logged only
                if _is_missing(value):
                    ok = False
                else:
                    total += weight * float(value)
            raw.append(total if ok else 0.0)
            valid.append(ok)
        scores = list(raw)
        if a.missing_eos_penalty is not None:
            for i in range(N):
                if not bool(rollout.ended[i]):
                    scores[story_of[i]] -= a.missing_eos_penalty
        if a.use_score_scaling:
            self.moments.update([s for s, ok in zip(scores, valid) if ok])
            shift = self.moments.mean if a.use_score_norm else 0.0
            scores = [(s - shift) / (self.moments.std + _EPS_SCALE) for s in scores]
        if a.score_clip is not None:
            scores = [min(max(s, -a.score_clip), a.score_clip) for s in scores]
        scores = [s if ok else 0.0 for s, ok in zip(scores, valid)]

        # per-token KL and rewards, whitening, GAE
        coef = self.kl_coef
        kl, non_score, rewards = {}, {}, {}
        for i in range(N):
            for t in range(lengths[i]):
                if a.kl_estimator == "k1":
                    k = old[i][t] - ref[i][t]
                else:
                    log_r = ref[i][t] - old[i][t]
                    k = math.expm1(log_r) - log_r
                kl[i, t] = k
                non_score[i, t] = -coef * k
                rewards[i, t] = -coef * k + (scores[story_of[i]] if t == lengths[i] - 1 else 0.0)
        train_keys = [(i, t) for i in range(N) if valid[story_of[i]] for t in range(lengths[i])]
        if a.whiten_rewards:
            rewards = _whiten(rewards, train_keys, shift_mean=False)
        advantages, returns = {}, {}
        for i in range(N):
            last = 0.0
            for t in reversed(range(lengths[i])):
                next_value = values[i][t + 1] if t + 1 < lengths[i] else 0.0
                delta = rewards[i, t] + a.gamma * next_value - values[i][t]
                last = delta + a.gamma * a.lam * last
                advantages[i, t] = last
                returns[i, t] = last + values[i][t]
        if a.whiten_advantages:
            advantages = _whiten(advantages, train_keys, shift_mean=True)

        lr = self._lr()
        stats, early_stopped, updates = self._update(step, rollout, valid, old, values, advantages, returns)

        story_kl = [0.0] * B
        story_non_score = [0.0] * B
        story_neg_logp = [0.0] * B
        for i in range(N):
            for t in range(lengths[i]):
                story_kl[story_of[i]] += kl[i, t]
                story_non_score[story_of[i]] += non_score[i, t]
                story_neg_logp[story_of[i]] -= old[i][t]
        if a.adaptive_kl:
            error = min(max(_mean(story_kl) / a.target - 1.0, -0.2), 0.2)
            self.kl_coef *= 1.0 + error * B / a.horizon

        metrics = {}
        for f, name in enumerate(self.names):
            got = [float(row[f]) for row in reward_values if not _is_missing(row[f])]
            metrics[f"rewards/{name}/mean"] = _mean(got)
            metrics[f"rewards/{name}/std"] = _std(got)
        scorable = [b for b in range(B) if valid[b]]
        metrics.update({
            "reward": _mean([raw[b] for b in scorable]),
            "objective/scores": _mean([raw[b] for b in scorable]),
            "ppo/masked_frac": 1.0 - len(scorable) / B,
            "ppo/truncated_frac": sum(not bool(e) for e in rollout.ended.tolist()) / N,
            "objective/kl": _mean(story_kl),
            "objective/kl_coef": coef,
            "objective/entropy": _mean(story_neg_logp),
            "objective/non_score_reward": _mean(story_non_score),
            "objective/rlhf_reward": _mean([scores[b] + story_non_score[b] for b in scorable]),
            "ppo/updates": float(updates),
            "ppo/early_stopped": float(early_stopped),
            "lr": lr,
        })
        for key, xs in stats.items():
            metrics[key] = _mean(xs)
        self.history.append(metrics)
        return metrics

    def _lr(self) -> float:
        a = self.args
        if a.lr_scheduler_type == "linear":
            return a.learning_rate * max(0.0, 1.0 - self.updates / self.total_updates)
        return a.learning_rate

    def _update(self, step, rollout, valid, old, values, advantages, returns):
        a = self.args
        B = rollout.num_stories
        story_of = rollout.story.tolist()
        lengths = rollout.lengths.tolist()
        stats: dict[str, list[float]] = {k: [] for k in (
            "policy/entropy", "policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value", "val/clipfrac",
            "val/vpred")}
        self.micro_batches.append([])
        if not any(valid):  # nothing scorable: no update, NaN statistics
            return stats, False, 0
        mb = B // a.num_mini_batches
        micro = mb // a.gradient_accumulation_steps
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + 7919 * step + 1)
        applied = 0
        for _epoch in range(a.num_ppo_epochs):
            order = torch.randperm(B, generator=gen).tolist()
            for m in range(a.num_mini_batches):
                kls = []
                for k in range(a.gradient_accumulation_steps):
                    stories = order[m * mb + k * micro : m * mb + (k + 1) * micro]
                    self.micro_batches[-1].append(stories)
                    pg_terms, vf_terms, pg_clipped, vf_clipped, log_ratios, entropies, vpreds = ([] for _ in range(7))
                    anchor = []  # every output of the forward, for a zero loss when nothing is scorable
                    for b in stories:
                        for i, logits, vpred in self._outputs(self.model.policy, rollout, b, critic=True):
                            anchor += [logits.sum(), vpred.sum()]
                            if not valid[story_of[i]]:
                                continue
                            new = self._logprobs(logits, rollout.response[i])
                            ent = self._entropies(logits.detach())
                            for t in range(lengths[i]):
                                A, R = advantages[i, t], returns[i, t]
                                log_ratio = new[t] - old[i][t]
                                ratio = torch.exp(log_ratio)
                                unclipped = -A * ratio
                                clipped = -A * torch.clamp(ratio, 1.0 - a.cliprange, 1.0 + a.cliprange)
                                pg_terms.append(torch.maximum(unclipped, clipped))
                                pg_clipped.append(float((clipped > unclipped).item()))
                                log_ratios.append(log_ratio.item())
                                v_old = values[i][t]
                                v = vpred[t]
                                v_clip = torch.clamp(v, v_old - a.cliprange_value, v_old + a.cliprange_value)
                                e1, e2 = (v - R) ** 2, (v_clip - R) ** 2
                                vf_terms.append(torch.maximum(e1, e2))
                                vf_clipped.append(float((e2 > e1).item()))
                                entropies.append(ent[t])
                                vpreds.append(v.item())
                    n = len(pg_terms)
                    if n:
                        pg_loss = torch.stack(pg_terms).sum() / n
                        vf_loss = 0.5 * torch.stack(vf_terms).sum() / n
                    else:  # an all-masked micro-batch: a zero loss (zero gradients, the step still happens)
                        pg_loss = vf_loss = 0.0 * torch.stack(anchor).sum()
                    ((pg_loss + a.vf_coef * vf_loss) / a.gradient_accumulation_steps).backward()
                    approx_kl = 0.5 * sum(x * x for x in log_ratios) / n if n else 0.0
                    kls.append(approx_kl)
                    for key, value in (("policy/entropy", sum(entropies) / n if n else 0.0),
                                       ("policy/approxkl", approx_kl),
                                       ("policy/clipfrac", sum(pg_clipped) / n if n else 0.0),
                                       ("loss/policy", pg_loss.item()), ("loss/value", vf_loss.item()),
                                       ("val/clipfrac", sum(vf_clipped) / n if n else 0.0),
                                       ("val/vpred", sum(vpreds) / n if n else 0.0)):
                        stats[key].append(value)
                if a.early_stopping and sum(kls) / len(kls) > 1.5 * a.target_kl:
                    for p in self.params:  # not applied, and nothing of it left for later
                        p.grad = None
                    return stats, True, applied
                if a.max_grad_norm is not None:
                    grads = [p.grad for p in self.params if p.grad is not None]
                    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
                    factor = a.max_grad_norm / (norm + 1e-6)
                    if factor < 1.0:
                        self.clipped_updates += 1
                        for g in grads:
                            g.mul_(factor)
                for group in self.optimizer.param_groups:
                    group["lr"] = self._lr()
                self.optimizer.step()
                for p in self.params:
                    p.grad = None
                self.updates += 1
                applied += 1
        return stats, False, applied

    # -- comparing with the trainer ------------------------------------------------------------
    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}


def run_reference(initial, trainer, recording: Recording) -> ReferencePPO:
    """Replay every recorded step of ``trainer`` (after its ``train()``)."""
    ref = ReferencePPO(initial, trainer.args, trainer.reward_weights.tolist(), trainer.reward_names,
                       trainer.num_steps)
    for step, rollout in enumerate(recording.rollouts):
        ref.step(step, rollout, recording.rewards(step))
    return ref


def assert_matches(trainer, history: list[dict], ref: ReferencePPO, atol: float = 1e-5, rtol: float = 1e-5,
                   param_atol: float = 2e-5) -> None:
    """The trainer's logged metrics (within ``atol``/``rtol``) and final
    parameters (within ``param_atol``/``rtol``) equal the reference's.

    Parameters get a little more room: AdamW divides each gradient entry by
    its running RMS, so an entry whose gradient is near zero turns the
    trainer's float32 rounding into a step error of up to ~1e-3·lr (seen:
    up to 6e-6 at lr 5e-3 over 4-8 updates, where the parameters moved by
    ~1e-2)."""
    assert len(history) == len(ref.history)
    for step, (got, want) in enumerate(zip(history, ref.history)):
        for key, expected in want.items():
            value = got[key]
            value = math.nan if value is None else value
            if math.isnan(expected):
                assert math.isnan(value), f"step {step + 1} {key}: {value} (reference NaN)"
                continue
            assert math.isclose(value, expected, rel_tol=rtol, abs_tol=atol), \
                f"step {step + 1} {key}: trainer {value!r}, reference {expected!r}"
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    ours = dict(wrapper.named_parameters())
    theirs = ref.parameters_by_name()
    assert set(theirs) <= set(ours)
    bad = {}
    for name, want in theirs.items():
        diff = (ours[name].detach().double() - want).abs()
        if bool((diff > param_atol + rtol * want.abs()).any()):
            bad[name] = float(diff.max())
    assert not bad, f"{len(bad)} parameter(s) differ from the reference, e.g. {sorted(bad.items())[:3]}"
