"""Options of storyrl's PPO trainer (:class:`storyrl.training.storyteller.rl.ppo.PPOTrainer`).

Names follow TRL's last PPO configs (v0.11 ``PPOConfig`` and the later
``PPOConfig`` of ``trl.experimental.ppo``) so that users recognise them;
defaults are theirs (lr 3e-6, 4 PPO epochs, kl_coef 0.05, clip 0.2, value
clip 0.2, vf_coef 0.1, γ 1.0, λ 0.95; adaptive KL: target 6, horizon 10000).

Batch sizes differ from TRL's on purpose (TRL's ``per_device_train_batch_size``
was the micro-batch and the rollout was ``micro × accumulation ×
minibatches``): here ``per_device_train_batch_size`` is the number of prompts
one process rolls out per step, a minibatch is ``1/num_mini_batches`` of it
and each minibatch is split into ``gradient_accumulation_steps`` micro-batches
(one forward/backward each). For TAPM policies a rollout item is a story;
its sentences are split the same way.

This module stays import-light (no torch): it is read by the RL config and by
``storyrl --help``.
"""

from __future__ import annotations

from dataclasses import dataclass

from storyrl.config import Config, option

__all__ = ["KL_ESTIMATORS", "PPOConfig", "TRACKERS", "tracker_problems"]

KL_ESTIMATORS = ("k1", "k3")
#: accelerate's tracker names (``Accelerator(log_with=...)``), plus all/none.
TRACKERS = (
    "none", "all", "tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio",
)
#: The package each tracker needs (tensorboard: either, as transformers takes).
_TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX")}


def tracker_problems(report_to: str | list[str]) -> list[str]:
    """Unknown tracker names, and trackers whose package is not installed
    (found without importing it): TRL/accelerate would fail only once the
    models are loaded."""
    from importlib.util import find_spec

    trackers = [report_to] if isinstance(report_to, str) else list(report_to)
    problems = [f"report_to: unknown tracker {t!r}; known: {', '.join(TRACKERS)}" for t in trackers
                if t not in TRACKERS]
    for tracker in trackers:
        if tracker in TRACKERS and tracker not in ("none", "all"):
            packages = _TRACKER_PACKAGES.get(tracker, (tracker,))
            if not any(find_spec(package) for package in packages):
                problems.append(f"report_to: {tracker} is not installed (pip install {packages[0]}); "
                                "or set report_to: none (history.jsonl keeps every log)")
    return problems


@dataclass
class PPOConfig(Config):
    """Settings of :class:`storyrl.training.storyteller.rl.ppo.PPOTrainer`."""

    _field_word = "key"

    output_dir: str | None = option(None, "Directory for checkpoint-<step>/, history.jsonl and tracker logs "
                                    "(required by the trainer; the RL config fills it in).")
    # -- optimisation ---------------------------------------------------------
    learning_rate: float = option(3e-6, "AdamW learning rate.", min=0.0)
    lr_scheduler_type: str = option("linear", "Learning rate schedule over the run.", choices=("linear", "constant"))
    weight_decay: float = option(0.0, "AdamW decoupled weight decay.", min=0.0)
    max_grad_norm: float | None = option(1.0, "Clip the gradient norm to this (null: no clipping).", min=0.0)
    per_device_train_batch_size: int = option(8, "Prompts each process rolls out per PPO step.", min=1)
    num_mini_batches: int = option(1, "Minibatches the rollout is split into per PPO epoch.", min=1)
    gradient_accumulation_steps: int = option(1, "Micro-batches per minibatch (one optimizer step per minibatch).",
                                              min=1)
    num_ppo_epochs: int = option(4, "Passes over each rollout.", min=1)
    max_steps: int | None = option(None, "PPO steps (rollout + update) to run; wins over total_episodes.", min=1)
    total_episodes: int | None = option(None, "Prompts to roll out in total (all processes); default "
                                        "num_train_epochs passes over the dataset.", min=1)
    num_train_epochs: int = option(1, "Passes over the prompt dataset when neither max_steps nor total_episodes "
                                   "is set.", min=1)
    seed: int = option(0, "Seed of the data order, the sampling and the value head's initialisation.")
    mixed_precision: str = option("no", "accelerate mixed precision: no (the weights' own dtype), fp16 "
                                  "(autocast + GradScaler, CUDA or CPU), bf16 (autocast).",
                                  choices=("no", "fp16", "bf16"))
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass (saves memory).")
    # -- PPO ------------------------------------------------------------------
    cliprange: float = option(0.2, "PPO clip range of the probability ratio.", min=0.0)
    cliprange_value: float = option(0.2, "Clip range of the value prediction around the rollout's value.", min=0.0)
    vf_coef: float = option(0.1, "Weight of the value loss.", min=0.0)
    gamma: float = option(1.0, "Discount factor.", min=0.0, max=1.0)
    lam: float = option(0.95, "GAE lambda.", min=0.0, max=1.0)
    whiten_rewards: bool = option(False, "Whiten the per-token rewards (without shifting their mean) before GAE.")
    whiten_advantages: bool = option(True, "Whiten the advantages (TRL always did).")
    # -- KL to the reference ----------------------------------------------------
    kl_coef: float = option(0.05, "Weight of the per-token KL penalty (initial value with adaptive_kl).", min=0.0)
    kl_estimator: str = option("k1", "Per-token KL estimator: k1 = log p − log q, k3 = (r − 1) − log r, "
                               "r = q/p (Schulman's low-variance, non-negative estimator).", choices=KL_ESTIMATORS)
    adaptive_kl: bool = option(False, "Adapt kl_coef towards a target KL (Ziegler et al., 2019).")
    target: float = option(6.0, "Target KL of the adaptive controller (sequence KL, summed over tokens).", min=0.0)
    horizon: int = option(10000, "Horizon of the adaptive KL controller, in episodes.", min=1)
    early_stopping: bool = option(False, "Stop a step's PPO epochs once a minibatch's approx KL exceeds "
                                  "1.5 × target_kl (TRL v0.11's rule).")
    target_kl: float = option(1.0, "KL threshold of early_stopping.", min=0.0)
    # -- scores -------------------------------------------------------------------
    use_score_scaling: bool = option(False, "Divide scores by their running standard deviation.")
    use_score_norm: bool = option(False, "With use_score_scaling, also subtract the running mean.")
    score_clip: float | None = option(None, "Clip (scaled) scores to ±score_clip.", min=0.0)
    missing_eos_penalty: float | None = option(None, "Subtract this from the score of a response that does not "
                                               "end in the stop token (truncated by response_length).", min=0.0)
    # -- generation -------------------------------------------------------------
    response_length: int = option(128, "Most new tokens per response (per sentence for TAPM policies).", min=1)
    temperature: float = option(0.7, "Sampling temperature of the rollouts (logprobs use the same).", min=1e-6)
    top_p: float = option(1.0, "Nucleus sampling mass of the rollouts.", min=0.0, max=1.0)
    top_k: int = option(0, "Top-k of the rollouts (0: off).", min=0)
    stop_token: str = option("eos", "Cut responses after the first stop token: eos = the tokenizer's EOS, "
                             "none = no cut.", choices=("eos", "none"))
    stop_token_id: int | None = option(None, "Token id to cut responses after (wins over stop_token).", min=0)
    merge_adapters_for_sampling: bool = option(True, "Sample the rollouts with the policy's LoRA adapters merged "
                                               "into a copy of the weights they adapt, restored bit for bit "
                                               "afterwards (storyrl.training.storyteller.rl.sampling): as fast as "
                                               "generate on merged weights, one extra copy of those weights while "
                                               "sampling; "
                                               "false: through peft's unmerged adapters.")
    # -- models -------------------------------------------------------------------
    value_model: str | None = option(None, "Value model: null = a value head on the policy; else a path or hub "
                                     "name of a sequence-classification model (num_labels=1).")
    tapm_features: str | None = option(None, "Feature directory of a TAPM policy (storyrl.generators.tapm).")
    # -- logging and checkpoints --------------------------------------------------
    logging_steps: int = option(1, "Log metrics every this many steps.", min=1)
    save_steps: int | None = option(100, "Write checkpoint-<step>/ every this many steps (null: never).", min=1)
    save_total_limit: int | None = option(None, "Keep only the newest this many checkpoints.", min=1)
    num_sample_stories: int = option(3, "Sample stories written to history.jsonl at each logged step.", min=0)
    report_to: str | list[str] = option("none", "accelerate trackers: tensorboard, wandb, ... (a name or a list), "
                                        "all, or none.")

    def _problems(self) -> list[str]:
        problems = []
        b = self.per_device_train_batch_size
        if b % self.num_mini_batches:
            problems.append(f"per_device_train_batch_size ({b}) must be divisible by num_mini_batches "
                            f"({self.num_mini_batches})")
        elif (b // self.num_mini_batches) % self.gradient_accumulation_steps:
            problems.append(f"a minibatch ({b // self.num_mini_batches} prompts) must be divisible by "
                            f"gradient_accumulation_steps ({self.gradient_accumulation_steps})")
        problems += tracker_problems(self.report_to)
        if self.use_score_norm and not self.use_score_scaling:
            problems.append("use_score_norm needs use_score_scaling")
        if self.mixed_precision == "bf16":
            import torch  # only here: the default (no) keeps this module torch-free

            from storyrl.models.runtime import cuda_native_bf16

            if torch.cuda.is_available() and not cuda_native_bf16():
                problems.append("mixed_precision: bf16 needs a GPU with bf16 support and this CUDA device has none; "
                                "use fp16 or no")
        return problems

    @property
    def trackers(self) -> list[str]:
        """``report_to`` as accelerate's ``log_with`` list (empty for none)."""
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        return [n for n in names if n != "none"]
