"""The arithmetic of PPO for language models, as pure tensor functions.

Shapes: ``(N, T)`` tensors hold one row per response sequence and one column
per response token; ``mask`` (bool or 0/1, same shape) marks the real tokens
that count. Responses are right-padded, so a row's real tokens are a prefix
of it. Nothing here reads a model or a config: :mod:`storyrl.training.storyteller.rl.ppo`
wires these together, and ``tests/test_ppo_math.py`` checks each against hand
computations.

The formulas follow TRL's last PPO trainers (the v0.11 ``PPOTrainer`` and
the later ``trl.experimental.ppo``) unless a docstring says otherwise:

* masked mean / variance (unbiased, Bessel-corrected) / whitening, with
  whitening that by default shifts the mean to 0 (``shift_mean=False`` keeps
  it, as TRL does for rewards);
* per-token KL estimators between the policy ``p`` and the reference ``q``
  at the sampled token: k1 = log p − log q, k3 = (r − 1) − log r with
  r = q/p (Schulman, "Approximating KL divergence"; unbiased and ≥ 0);
* per-token rewards −kl_coef·KL with the sequence score added at its last
  real token (TRL added it one position later, on the first padding token);
* GAE (Schulman et al., 2016) over each masked row, values and rewards past
  the row's end counting 0; returns = advantages + values;
* PPO-clip policy loss, clipped value loss (×0.5), their clip fractions, and
  the approximate KL 0.5·mean(log-ratio²);
* the adaptive KL controller of Ziegler et al. (2019) and running moments
  (Chan et al.'s parallel update) for score scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "gae",
    "kl_k1",
    "kl_k3",
    "kl_per_token",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "scale_scores",
    "token_rewards",
    "value_loss",
]


def _as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (over ``dim``, or all).

    An all-false mask gives 0 rather than NaN: a micro-batch whose samples
    were all masked (unscorable) then contributes a zero loss that still
    backpropagates, so that every process runs the same backward passes."""
    m = _as_float_mask(mask, values)
    total = (values * m).sum() if dim is None else (values * m).sum(dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` where ``mask`` is true; ``unbiased`` applies
    Bessel's correction n/(n − 1). ValueError with fewer than 2 (unbiased)
    or 1 masked entries."""
    n = int(mask.sum().item())
    if n < (2 if unbiased else 1):
        raise ValueError(f"masked_var: {n} masked value(s) are too few for a variance")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(values − mean) / sqrt(var + eps)`` with the masked mean and unbiased
    variance; with ``shift_mean=False`` the mean is added back (only the
    scale changes). Entries outside the mask are transformed too (callers
    zero them); with fewer than two masked entries the values are returned
    unchanged (there is no spread to normalise)."""
    if int(mask.sum().item()) < 2:
        return values
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log p − log q per token (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r − 1) − log r per token with r = q/p = exp(log q − log p)
    (unbiased, never negative, lower variance when p ≈ q)."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """The per-token KL estimate named by ``estimator`` (``k1`` or ``k3``)."""
    if estimator == "k1":
        return kl_k1(logprobs, ref_logprobs)
    if estimator == "k3":
        return kl_k3(logprobs, ref_logprobs)
    raise ValueError(f"kl estimator must be k1 or k3, got {estimator!r}")


def token_rewards(kl: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``−kl_coef · kl`` on the masked tokens, plus each
    row's score at its last real token (the last true entry of its mask
    row). Rows with no real token get no score. Returns ``(rewards,
    non_score_rewards)``, both 0 outside the mask."""
    m = _as_float_mask(mask, kl)
    non_score = -kl_coef * kl * m
    rewards = non_score.clone()
    lengths = mask.long().sum(dim=1)
    rows = torch.nonzero(lengths > 0, as_tuple=True)[0]
    rewards[rows, lengths[rows] - 1] += scores[rows].to(rewards.dtype)
    return rewards, non_score


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row.

    ``δ_t = r_t + γ·V_{t+1} − V_t`` and ``A_t = δ_t + γλ·A_{t+1}``, where
    rewards and values outside the mask count 0 (so the value after a row's
    last real token is 0: the episode ends there). Returns ``(advantages,
    returns)`` with ``returns = advantages + values``, both 0 outside the
    mask."""
    m = _as_float_mask(mask, values)
    rewards, values = rewards * m, values * m
    T = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = advantages * m
    return advantages, (advantages + values) * m


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip: mean over masked tokens of ``max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε))``
    with ``ρ = exp(logprobs − old_logprobs)``. Returns ``(loss, clipfrac,
    approx_kl)``: clipfrac is the masked fraction of tokens where the clipped
    term is the larger, approx_kl = 0.5·masked mean of (log ρ)² (no grads)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = 0.5 * masked_mean(log_ratio.float() ** 2, mask)
    return loss, clipfrac, approx_kl


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 · masked mean of max((V − R)², (V_clip − R)²)``
    with ``V_clip = clip(V, V_old − ε, V_old + ε)``. Returns ``(loss,
    clipfrac)``, clipfrac the masked fraction where the clipped error is the
    larger."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac


def scale_scores(scores: torch.Tensor, mean: float | None = None, std: float | None = None,
                 clip: float | None = None, eps: float | None = None) -> torch.Tensor:
    """TRL v0.11's score scaling: ``scores / (std + eps)`` (with ``mean``
    given, ``(scores − mean) / (std + eps)``; with ``std`` None no scaling),
    then clipped to ``±clip`` when given. ``eps`` defaults to the dtype's
    machine epsilon."""
    if std is not None:
        eps = torch.finfo(scores.dtype).eps if eps is None else eps
        shifted = scores - mean if mean is not None else scores
        scores = shifted / (std + eps)
    if clip is not None:
        scores = torch.clamp(scores, -clip, clip)
    return scores


class FixedKLController:
    """A constant KL coefficient (``value``), with the adaptive one's interface."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Ziegler et al. (2019): after each step, with ``current`` the observed
    KL and ``n_steps`` the episodes in it,
    ``e = clip(current / target − 1, −0.2, 0.2)`` and
    ``value ← value · (1 + e · n_steps / horizon)``."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0:
            raise ValueError(f"adaptive KL: target must be > 0, got {target}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), int(horizon)

    def update(self, current: float, n_steps: int) -> None:
        if not math.isfinite(current):
            return  # a step without a KL estimate leaves the coefficient alone
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


@dataclass
class RunningMoments:
    """Running mean and variance of every score seen (Chan et al.'s
    parallel combination of batch moments), for score scaling.

    ``var`` is the population variance of all values so far, ``std`` its
    unbiased square root (n/(n − 1) corrected). Starts at mean 0, var 1 and a
    negligible count (TRL's convention), so the first batch sets them."""

    mean: float = 0.0
    var: float = 1.0
    count: float = 1e-24

    @property
    def std(self) -> float:
        n = self.count
        return math.sqrt(self.var * n / (n - 1)) if n > 1 else math.sqrt(self.var)

    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Add a batch; returns the batch's mean and unbiased std (NaN std
        for a single value). An empty batch changes nothing."""
        xs = xs.detach().double().flatten()
        n = xs.numel()
        if n == 0:
            return math.nan, math.nan
        batch_mean = float(xs.mean())
        batch_var = float(((xs - batch_mean) ** 2).mean())  # population
        delta = batch_mean - self.mean
        total = self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total
        return batch_mean, math.sqrt(batch_var * n / (n - 1)) if n > 1 else math.nan

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])
