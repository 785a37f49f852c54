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

Tolerances (absolute, on log-probabilities over a 37-token vocabulary, values
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


def _ppo(tmp_path, base, weights="fp32", mixed="no", lora=False, **options):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer, model = base
    model = copy.deepcopy(model).to(DTYPES[weights])
    args = ppo_args(tmp_path / f"{weights}-{mixed}-{lora}", mixed_precision=mixed, num_mini_batches=1,
                    gradient_accumulation_steps=1, num_ppo_epochs=1, max_steps=1, response_length=8,
                    whiten_advantages=False,  # whitened, the first policy loss is 0 whatever the precision
                    **options)
    return PPOTrainer(model, constant, args, text_dataset(), processing_class=tokenizer,
                      peft_config=lora_config() if lora else None)


def _first_update(trainer, rollout, head_state):
    """(log-probs, reference log-probs, values, policy loss, value loss,
    trainable weights before and after) of one update on ``rollout``."""
    if head_state is not None:  # the same critic as the fp32 trainer's (its init draws from the RNG)
        trainer.accelerator.unwrap_model(trainer.model).value_head.load_state_dict(head_state)
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


@pytest.fixture(scope="module")
def value_model_dir(base, tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    tokenizer, policy = base
    torch.manual_seed(1)
    model = LlamaForSequenceClassification(policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1}))
    directory = tmp_path_factory.mktemp("value_model")
    model.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("weights,mixed,lora,critic", [("bf16", "no", False, torch.bfloat16),
                                                       ("fp16", "no", True, torch.float32),
                                                       ("fp32", "bf16", False, torch.float32)])
def test_ppo_value_model_at_each_precision_matches_fp32(tmp_path, base, fp32_run, value_model_dir, weights, mixed,
                                                        lora, critic):
    """ppo.value_model loads in the policy's dtype, fp16 excepted (it
    trains every weight); its values match the fp32 critic's."""
    rollout = fp32_run[0]
    reference = _first_update(_ppo(tmp_path / "ref", base, value_model=value_model_dir), rollout, None)
    trainer = _ppo(tmp_path, base, weights, mixed, lora, value_model=value_model_dir)
    value_model = trainer.accelerator.unwrap_model(trainer.model).value_model
    assert value_model.dtype == critic
    got = _first_update(trainer, rollout, None)
    tol = TOLERANCE["bf16" if "bf16" in (weights, mixed) else "fp16"]
    diff = ((got[2] - reference[2]).abs() * rollout.response_mask()).max().item()
    assert diff <= tol, f"values: max |diff| {diff:.4g} > {tol}"
    assert abs(got[4] - reference[4]) <= tol and math.isfinite(got[4])
    moved = [n for n in got[6] if not torch.equal(got[6][n], got[7][n])]
    assert any(n.startswith("value_model.") for n in moved)


def test_fp16_weights_are_refused_without_lora_and_bf16_on_a_gpu_without_it(tmp_path, monkeypatch):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.ppo.config import PPOConfig

    data = tmp_path / "d.jsonl"
    data.write_text('{"story_id": "a", "story": "x .", "image_ids": ["1"]}\n')
    base_keys = {"model": "m", "policy": "causal_lm", "setting": "text", "data": str(data),
                 "output_dir": str(tmp_path / "o"), "rewards": ["bleu"], "algorithm": "grpo"}
    if not torch.cuda.is_available():  # TRL's fp16 flag would silently train in fp32 here
        for algorithm in ("grpo", "rloo"):
            with pytest.raises(ValueError, match=rf"{algorithm}.fp16: TRL's Trainer makes fp16 autocast and its "
                                                 r"GradScaler on CUDA only"):
                RLConfig.from_mapping({**base_keys, "algorithm": algorithm, algorithm: {"fp16": True}})
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


# -- GRPO / RLOO (TRL) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_assets(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("trl")
    data = root / "data.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for k in range(4):
            f.write(json.dumps({"story_id": f"s{k}", "story": CORPUS[k], "image_ids": ["a", "b", "c"]}) + "\n")
    return {"data": str(data), "model": tiny_models.save_tiny_llama(root / "llama", CORPUS)}


def _trl_run(assets, out, algorithm, precision="fp32", lora=False, **flags):
    """One GRPO/RLOO step through storyrl's train_trl; returns (trainer,
    the fixed batch's log-probabilities at the first step under the
    trainer's own autocast, trainable weights before and after)."""
    from transformers import TrainerCallback

    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.data import build_dataset
    from storyrl.training.storyteller.rl.policy import load_policy
    from storyrl.training.storyteller.rl.trl_trainers import train_trl

    section = {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 6,
               "learning_rate": 1e-3, "beta": 0.1, "logging_steps": 1, "save_strategy": "no", **flags}
    config = RLConfig.from_mapping({
        "algorithm": algorithm, "model": assets["model"], "data": assets["data"], "output_dir": str(out),
        "rewards": ["repetition", "bleu"], "reward_weights": [0.0, 1.0], "max_steps": 1, "prompt": "P1",
        "policy": "causal_lm", "setting": "text", "precision": precision,
        "lora": {"enabled": lora, "r": 4, "alpha": 8}, algorithm: section})
    policy = load_policy(config)
    assert policy.model.dtype == DTYPES[precision]
    dataset = build_dataset(config, policy.kind, policy.processing_class)
    ids = policy.tokenizer(CORPUS[:2], return_tensors="pt", padding=True)["input_ids"]
    seen = {}

    class FixedBatch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            # the prepared model: its forward runs in the trainer's autocast
            seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            with torch.no_grad():
                logits = model(input_ids=ids.to(model.device)).logits.float()
            seen["logprobs"] = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen["after"] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    rewards = config.build_rewards()
    for reward in rewards:
        reward.setup()
    trainer = train_trl(config, policy, dataset, rewards, progress=False, callbacks=[FixedBatch()])
    return trainer, seen


TRL_CASES = [("bf16", False, {"bf16": True}), ("fp32", False, {"bf16": True}), ("bf16", False, {}),
             ("fp16", True, {}), ("bf16", True, {"bf16": True})]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
@pytest.mark.parametrize("precision,lora,flags", TRL_CASES,
                         ids=[f"{p}-{'lora' if lo else 'full'}-{'bf16' if f else 'nomp'}" for p, lo, f in TRL_CASES])
def test_trl_step_at_each_precision_trains_and_matches_fp32(trl_assets, tmp_path, algorithm, precision, lora, flags):
    _, reference = _trl_run(trl_assets, tmp_path / "fp32", algorithm, lora=lora)
    trainer, seen = _trl_run(trl_assets, tmp_path / precision, algorithm, precision, lora, **flags)
    tol = TOLERANCE["bf16" if "bf16" in (precision, *flags) else "fp16"]
    diff = (seen["logprobs"] - reference["logprobs"]).abs().max().item()
    assert diff <= tol, f"fixed batch log-probs: max |diff| {diff:.4g} > {tol}"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(v) for v in losses)
    moved = [n for n in seen["before"] if not torch.equal(seen["before"][n], seen["after"][n])]
    assert moved and all(("lora_" in n) == lora or not lora for n in moved)


# -- PPO with a vision-language policy -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("weights,lora", [("bf16", False), ("fp16", True)])
def test_ppo_vlm_at_each_precision_matches_fp32(tmp_path, weights, lora):
    """LLaVA-NeXT: pixel values go in the policy's dtype (the rollout casts
    them); log-probs, values and losses as the text policy's."""
    import dataclasses

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from storyrl.training.storyteller.rl.ppo import PPOTrainer
    from test_ppo import vlm_dataset

    directory = tiny_models.save_tiny_vlm(tmp_path / "llava_next", "llava_next", CORPUS)
    images = tiny_models.write_images(tmp_path / "img", n=3)
    processor = AutoProcessor.from_pretrained(directory)
    processor.chat_template = tiny_models.LLAVA_CHAT_TEMPLATE

    def trainer_at(dtype, out, peft):
        model = AutoModelForImageTextToText.from_pretrained(directory, dtype=DTYPES[dtype])
        args = ppo_args(tmp_path / out, num_mini_batches=1, gradient_accumulation_steps=1, num_ppo_epochs=1,
                        max_steps=1, response_length=6, whiten_advantages=False)
        return PPOTrainer(model, constant, args, vlm_dataset(images), processing_class=processor,
                          peft_config=lora_config() if peft else None)

    reference = trainer_at("fp32", "fp32", False)
    torch.manual_seed(0)
    reference.model.eval()
    with torch.no_grad():
        rollout = reference.adapter.rollout(reference.policy, reference._rows(0))
    head = snapshot(reference.accelerator.unwrap_model(reference.model).value_head)
    expected = _first_update(reference, rollout, head)
    trainer = trainer_at(weights, weights, lora)
    # as this trainer's own rollout would have them: pixel values in its dtype
    multimodal = {k: v.to(DTYPES[weights]) if v.is_floating_point() else v
                  for k, v in rollout.extra["multimodal"].items()}
    rollout = dataclasses.replace(rollout, extra={**rollout.extra, "multimodal": multimodal})
    got = _first_update(trainer, rollout, head)
    tol, mask = TOLERANCE[weights], rollout.response_mask()
    for name, mine, theirs in zip(("logprobs", "ref_logprobs", "values"), got[:3], expected[:3]):
        diff = ((mine - theirs).abs() * mask).max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.4g} > {tol}"
    assert abs(got[3] - expected[3]) <= tol and abs(got[4] - expected[4]) <= tol
    moved = [n for n in got[6] if not torch.equal(got[6][n], got[7][n])]
    assert any("value_head" in n for n in moved) and any(("lora_B" in n) if lora else ("language_model" in n)
                                                          for n in moved)


def test_ppo_stops_at_non_finite_log_probabilities(tmp_path, base):
    """What an fp16 overflow looks like to PPO: NaN logits in the forward.
    (On CUDA, sampling from them picks token 0 instead of raising.)"""
    from storyrl.training.runs import RunFailedError

    trainer = _ppo(tmp_path, base, "bf16")
    forward = trainer.adapter.forward

    def overflowing(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., 0] = float("inf")
        return out

    trainer.adapter.forward = overflowing
    with pytest.raises(RunFailedError, match=r"^step 1: the policy log-probabilities, reference log-probabilities "
                                             r"are NaN/inf \(weights bfloat16, mixed_precision no; an fp16 overflow"):
        trainer.train(progress=False)


@pytest.mark.parametrize("which", ["values", "old_logprobs"])
def test_ppo_stops_at_one_non_finite_token(tmp_path, base, which):
    """One overflowing token is enough to stop (its NaN would spread through
    the whole loss), and the values are checked like the log-probabilities
    (a bf16 critic overflows too); the message names what was non-finite."""
    from storyrl.training.runs import RunFailedError

    trainer = _ppo(tmp_path, base, "bf16")
    evaluate = trainer._evaluate

    def one_bad_token(rollout):
        out = dict(zip(("old_logprobs", "ref_logprobs", "values"), evaluate(rollout)))
        i, j = rollout.response_mask().nonzero()[-1].tolist()
        out[which] = out[which].clone()
        out[which][i, j] = float("inf")
        return out["old_logprobs"], out["ref_logprobs"], out["values"]

    trainer._evaluate = one_bad_token
    name = {"values": "values", "old_logprobs": "policy log-probabilities"}[which]
    with pytest.raises(RunFailedError, match=rf"^step 1: the {name} are NaN/inf \(weights bfloat16"):
        trainer.train(progress=False)
