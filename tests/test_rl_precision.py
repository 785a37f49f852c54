"""Precision is part of the RL trainers' contract (issue 30): PPO (policy,
value head, reference forward), GRPO and RLOO at fp16 and bf16 on the CPU
(torch runs both there) against the same tiny model in fp32.

PPO: one fixed rollout (sampled once, in fp32) is evaluated and trained on
by trainers that differ only in precision: the policy's and reference's
log-probabilities, the values and the first minibatch's policy and value
losses must match the fp32 trainer's within the tolerances below, and the
update must change the trainable weights. GRPO/RLOO: a step at each
precision trains (finite loss, adapters moved), and the fixed batch's
per-token log-probabilities under the trainer's own autocast match fp32.

Tolerances (absolute, on log-probabilities of a 64-word vocabulary, values
of order 1 and losses): fp16 keeps 11 significant bits, bf16 8, so bf16
gets 6x fp16's bound; measured (tiny LLaMA, 8 new tokens): log-probs
2.1e-4 fp16 / 1.4e-3 bf16, values 1.9e-3 / 1.1e-2, value loss 1.9e-4 /
2.2e-3, policy loss 3.2e-4 / 1.5e-3 (bounds 5e-3 / 3e-2).
"""

from __future__ import annotations

import copy
import math

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers)
import tiny_models

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from test_ppo import CORPUS, lora_config, ppo_args, snapshot, text_dataset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

TOLERANCE = {"fp16": 0.005, "bf16": 0.03}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


def constant(prompts, completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def base():
    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    return tokenizer, tiny_models.tiny_llama(tokenizer)


def _ppo(tmp_path, base, weights="fp32", mixed="no", lora=False):
    from storyrl.training.rl.ppo import PPOTrainer

    tokenizer, model = base
    model = copy.deepcopy(model).to(DTYPES[weights])
    args = ppo_args(tmp_path / f"{weights}-{mixed}-{lora}", mixed_precision=mixed, num_mini_batches=1,
                    gradient_accumulation_steps=1, num_ppo_epochs=1, max_steps=1, response_length=8,
                    whiten_advantages=False)  # whitened, the first policy loss is 0 whatever the precision
    return PPOTrainer(model, constant, args, text_dataset(), processing_class=tokenizer,
                      peft_config=lora_config() if lora else None)


def _first_update(trainer, rollout, head_state):
    """(log-probs, reference log-probs, values, policy loss, value loss,
    trainable weights before and after) of one update on ``rollout``."""
    head = trainer.accelerator.unwrap_model(trainer.model).value_head
    head.load_state_dict(head_state)  # the same critic as the fp32 trainer's (its init draws from the RNG)
    logprobs, ref_logprobs, values = trainer._evaluate(rollout)
    scores = torch.tensor([0.5, -0.2, 0.1, 0.3])  # fixed scores: the comparison is about the forwards
    batch = trainer._advantages(rollout, scores, torch.ones(4, dtype=torch.bool), logprobs, ref_logprobs, values)[0]
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    stats, updates, _ = trainer._update(batch, 0)
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return logprobs, ref_logprobs, values, stats["loss/policy"][0], stats["loss/value"][0], updates, trainable, after


@pytest.fixture(scope="module")
def fp32_run(base, tmp_path_factory):
    trainer = _ppo(tmp_path_factory.mktemp("fp32"), base)
    torch.manual_seed(0)
    rows = trainer._rows(0)
    trainer.model.eval()
    with torch.no_grad():
        rollout = trainer.adapter.rollout(trainer.policy, rows)
    head = snapshot(trainer.accelerator.unwrap_model(trainer.model).value_head)
    return rollout, head, _first_update(trainer, rollout, head)


# weights dtype, accelerate mixed precision, LoRA: every precision PPO accepts
# (fp16 weights only under LoRA: RLConfig refuses training fp16 weights).
PPO_CASES = [("bf16", "no", False), ("bf16", "no", True), ("fp16", "no", True), ("fp32", "bf16", False),
             ("fp32", "fp16", False), ("bf16", "bf16", True), ("fp16", "fp16", True)]


@pytest.mark.parametrize("weights,mixed,lora", PPO_CASES, ids=["-".join(map(str, c)) for c in PPO_CASES])
def test_ppo_first_update_at_each_precision_matches_fp32(tmp_path, base, fp32_run, weights, mixed, lora):
    rollout, head, reference = fp32_run
    trainer = _ppo(tmp_path, base, weights, mixed, lora)
    tol = TOLERANCE["bf16" if "bf16" in (weights, mixed) else "fp16"]
    got = _first_update(trainer, rollout, head)
    mask = rollout.response_mask()
    for name, mine, theirs in zip(("logprobs", "ref_logprobs", "values"), got[:3], reference[:3]):
        assert mine.dtype == torch.float32 and torch.isfinite(mine).all(), name
        diff = ((mine - theirs).abs() * mask).max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.4g} > {tol}"
    for name, mine, theirs in (("loss/policy", got[3], reference[3]), ("loss/value", got[4], reference[4])):
        assert math.isfinite(mine) and abs(mine - theirs) <= tol, f"{name}: {mine} vs fp32 {theirs}"
    before, after = got[6], got[7]
    # fp16 mixed precision: the GradScaler may skip a first step whose scaled gradients overflow
    if got[5] == 1 and not (mixed == "fp16" and trainer.accelerator.optimizer_step_was_skipped):
        moved = [n for n in before if not torch.equal(before[n], after[n])]
        assert any("value_head" in n for n in moved)
        assert any(("lora_B" in n) if lora else ("q_proj" in n) for n in moved)
    else:
        pytest.fail(f"the update was not applied (updates {got[5]}, skipped by the GradScaler)")


def test_fp16_weights_are_refused_without_lora_and_bf16_on_a_gpu_without_it(tmp_path, monkeypatch):
    from storyrl.training.rl.config import RLConfig
    from storyrl.training.rl.ppo.config import PPOConfig

    data = tmp_path / "d.jsonl"
    data.write_text('{"story_id": "a", "story": "x .", "image_ids": ["1"]}\n')
    base_keys = {"model": "m", "policy": "causal_lm", "setting": "text", "data": str(data),
                 "output_dir": str(tmp_path / "o"), "rewards": ["bleu"], "algorithm": "grpo"}
    with pytest.raises(ValueError, match=r"precision: fp16 would train the policy's own weights in fp16"):
        RLConfig.from_mapping({**base_keys, "precision": "fp16"})
    RLConfig.from_mapping({**base_keys, "precision": "fp16", "lora": {"enabled": True}})  # fp32 adapters: fine
    RLConfig.from_mapping({**base_keys, "precision": "bf16"})  # the CPU runs bf16
    # a CUDA GPU without bf16 (V100, T4): refused by key, never coerced
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match=r"^PPOConfig: mixed_precision: bf16 needs a GPU with bf16 support"):
        PPOConfig(mixed_precision="bf16")
    PPOConfig(mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"precision: bf16 needs a GPU with bf16 support"):
        RLConfig.from_mapping({**base_keys, "precision": "bf16", "grpo": {"use_cpu": True, "bf16": False}})
