"""storyrl's PPO trainer (storyrl.training.storyteller.rl.ppo) on CPU with tiny
random-weight policies built here: a LLaMA text policy, a LLaVA-NeXT
vision-language policy and a TAPM storyteller, each for two PPO steps.

Random weights write junk, so the repetition reward leaves most stories
unscorable: those are masked, which the tests also rely on. The PPO
arithmetic itself is checked against hand computations in test_ppo_math.py.
"""

from __future__ import annotations

import json
import math

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers)
import tiny_models

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from storyrl.training.storyteller.rl.ppo.config import PPOConfig  # noqa: E402

CORPUS = ["The cat sat on the mat. The dog ran to the park.", "A dog ran to the park. It played with a red ball.",
          "Tell me a story about these pictures.", "We went to the beach. The sea was blue."]
PROMPT = "Tell me a story about these pictures."
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


class WordCount:
    """A small custom reward: words / 10, with a component logged through
    ``log_metric`` and a column through ``log_extra``; records its calls."""

    __name__ = "word_count"

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, log_metric, log_extra, trainer_state, **columns):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        self.calls.append({"prompts": prompts, "texts": texts, "completion_ids": completion_ids, "columns": columns,
                           "trainer_state": trainer_state})
        words = [len(t.split()) for t in texts]
        log_metric("word_count/longest", float(max(words)))
        log_extra("word_count/words", words)
        return [w / 10 for w in words]


def likes_full_stops(model, tokenizer, bias=3.0):
    """Give the output layer a bias towards "." so that some random-weight
    stories have two sentences and the repetition-based rewards can score
    them (the rest stay unscorable and are masked)."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids(".")] = bias
    model.lm_head = head
    return model


def text_dataset(n=4):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * n,
                              "story_id": [f"s{k}" for k in range(n)],
                              "reference": ["The cat sat on the mat. The dog ran to the park."] * n})


def ppo_args(tmp_path, **options):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_mini_batches=2,
                  gradient_accumulation_steps=2, num_ppo_epochs=2, max_steps=2, response_length=10,
                  learning_rate=1e-3, temperature=1.0, save_steps=None, num_sample_stories=2)
    values.update(options)
    return PPOConfig(**values)


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before, after):
    return {k for k in before if not torch.equal(before[k], after[k])}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", **LORA)


def check_history(result, reward_names, extra_metrics=()):
    assert result.steps == 2 and [r["step"] for r in result.history] == [1, 2]
    for record in result.history:
        for key in ("loss/policy", "loss/value", "policy/approxkl", "policy/clipfrac", "val/clipfrac",
                    "objective/kl", "objective/entropy", "policy/entropy", "lr"):
            assert math.isfinite(record[key]), key
        for name in reward_names:
            assert f"rewards/{name}/mean" in record and f"rewards/{name}/std" in record
        for key in ("ppo/masked_frac", "story/sentences_mean", "story/distinct_2", "story/tokens_mean",
                    "time/generation", "time/reward", "time/optimization", *extra_metrics):
            assert key in record, key
        assert record["samples"] and "story" in record["samples"][0]
    with open(f"{result.output_dir}/history.jsonl", encoding="utf-8") as f:
        history = [json.loads(line) for line in f]
    with open(f"{result.output_dir}/samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    # scalars in history.jsonl, sample stories in samples.jsonl (as GRPO/RLOO write them)
    assert [r["step"] for r in history] == [1, 2] and "samples" not in history[1]
    assert history[1]["loss/policy"] == result.history[1]["loss/policy"]
    assert [s["step"] for s in samples] == [1, 2] and samples[1]["samples"] == result.history[1]["samples"]


# -- text policy --------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_text_policy_two_steps(tmp_path, lora):
    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    model = likes_full_stops(tiny_models.tiny_llama(tokenizer), tokenizer)
    initial = snapshot(model)
    custom = WordCount()
    weighted = create_reward("weighted", components=[{"reward": "repetition"},
                                                     {"reward": "repetition", "options": {"chunk_size": 2}}])
    rewards = [custom, create_reward("repetition"), weighted]
    trainer = PPOTrainer(model, rewards, ppo_args(tmp_path, gradient_checkpointing=lora), text_dataset(),
                         processing_class=tokenizer, peft_config=lora_config() if lora else None,
                         reward_weights=[1.0, 0.5, 0.5])
    head_before = snapshot(trainer.accelerator.unwrap_model(trainer.model).value_head)
    result = trainer.train()

    names = [r.__name__ for r in rewards]
    extra = ["word_count/longest", "repetition/unscorable_frac",
             # the composite reward's own components
             "weighted/unscorable_frac", "weighted/repetition/mean", "weighted/repetition_2/mean",
             "weighted/repetition/unscorable_frac"]
    check_history(result, names, extra)
    assert [s.get("word_count/words") is not None for s in result.history[0]["samples"]] == [True, True]
    # the reward saw TRL's keywords and every column but prompt, one entry per completion
    call = custom.calls[0]
    assert sorted(call["columns"]) == ["reference", "story_id"] and call["trainer_state"] is None
    assert len(call["texts"]) == len(call["columns"]["story_id"]) == len(call["completion_ids"]) == 4
    assert call["prompts"][0] == [{"role": "user", "content": PROMPT}]

    policy = trainer.policy
    head_after = snapshot(trainer.accelerator.unwrap_model(trainer.model).value_head)
    assert changed(head_before, head_after) == set(head_before)  # the value head trained
    if lora:
        after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                 for k, v in snapshot(policy).items() if "lora_" not in k}
        assert changed(initial, after) == set()  # frozen base weights
        lora_weights = {k: v for k, v in snapshot(policy).items() if "lora_B" in k}
        assert lora_weights and all(v.abs().sum() > 0 for v in lora_weights.values())  # B starts at 0
        assert trainer.ref_model is None  # the reference is the policy with adapters disabled
    else:
        moved = changed(initial, snapshot(policy))
        assert len(moved) > len(initial) // 2
        assert changed(initial, snapshot(trainer.ref_model)) == set()  # the frozen reference


def recording_tracker():
    from accelerate.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name = "recorder"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.config, self.logged = None, []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, dict(values)))

    return Recorder()


def test_trackers_and_save_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    tracker = recording_tracker()
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), WordCount(), ppo_args(tmp_path, max_steps=1),
                         text_dataset(), processing_class=tokenizer, trackers=[tracker])
    result = trainer.train(progress=False)
    # accelerate's trackers get the config once and every finite scalar of each step (samples stay in history)
    assert tracker.config["kl_coef"] == 0.05 and tracker.config["output_dir"] == str(tmp_path / "out")
    [(step, logged)] = tracker.logged
    record = result.history[0]
    assert step == 1 and set(logged) == {k for k, v in record.items() if isinstance(v, float)}
    assert logged["objective/kl"] == record["objective/kl"] and "samples" not in logged
    trainer.save_model(tmp_path / "final")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    for key, value in trainer.policy.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value)
    assert AutoTokenizer.from_pretrained(tmp_path / "final").get_vocab() == tokenizer.get_vocab()
    assert (tmp_path / "final" / "value_head.safetensors").is_file()


# -- vision-language policy -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    directory = tiny_models.save_tiny_vlm(root / "llava_next", "llava_next", CORPUS)
    paths = tiny_models.write_images(root / "img", n=3)
    return {"dir": directory, "images": paths}


def vlm_dataset(paths):
    from datasets import Dataset
    from PIL import Image

    images = [Image.open(p).convert("RGB") for p in paths]
    content = lambda n: [{"type": "image"}] * n + [{"type": "text", "text": PROMPT}]  # noqa: E731
    rows = [(images[:2], paths[:2]), (images[2:], paths[2:]), (images[:1], paths[:1]), (images[1:], paths[1:])]
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": content(len(i))}] for i, _ in rows],
        "images": [i for i, _ in rows],
        "story_images": [[str(p) for p in ps] for _, ps in rows],
        "story_id": [f"v{k}" for k in range(len(rows))],
    })


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_vlm_policy_two_steps(tmp_path, vlm, lora):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    processor = AutoProcessor.from_pretrained(vlm["dir"])
    processor.chat_template = tiny_models.LLAVA_CHAT_TEMPLATE  # the tiny LLaVA-NeXT processor has none
    model = likes_full_stops(AutoModelForImageTextToText.from_pretrained(vlm["dir"]), processor.tokenizer)
    initial = snapshot(model)
    custom = WordCount()
    trainer = PPOTrainer(model, [custom, create_reward("repetition")], ppo_args(tmp_path), vlm_dataset(vlm["images"]),
                         processing_class=processor, peft_config=lora_config() if lora else None)
    result = trainer.train()
    check_history(result, ["word_count", "repetition"], ["word_count/longest"])
    # the rewards got the per-position image paths (story_images) and the PIL images
    call = custom.calls[0]
    assert {"images", "story_images", "story_id"} <= set(call["columns"])
    assert all(isinstance(p, str) for p in call["columns"]["story_images"][0])
    policy = trainer.policy
    if lora:
        after = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                 for k, v in snapshot(policy).items() if "lora_" not in k}
        assert changed(initial, after) == set()
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in snapshot(policy).items())
    else:
        moved = changed(initial, snapshot(policy))
        # the language model and the vision tower both learn (images are re-fed in the forward)
        assert any("language_model" in k for k in moved) and any("vision_tower" in k for k in moved)
        assert changed(initial, snapshot(trainer.ref_model)) == set()


def sampling_logprobs_agree(trainer, rows, padded=True):
    """The log-probabilities PPO computes in its forward (left padding,
    positions, the response window, kept logits) equal those generate()
    sampled from (its processed scores: tempered, suppressed tokens
    removed), at every real response token."""
    from storyrl.training.storyteller.rl.ppo.rollout import response_logits

    policy = trainer.policy
    generate, captured = policy.generate, {}

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        captured["scores"] = torch.stack(out.scores, dim=1)
        return out.sequences

    policy.generate = recording_generate
    try:
        with torch.no_grad():
            rollout = trainer.adapter.rollout(policy, rows)
            stories = torch.arange(len(rows))
            seqs, inputs = trainer.adapter.model_inputs(rollout, stories)
            Q, T = rollout.query.shape[1], rollout.response.shape[1]
            logits = response_logits(trainer.adapter.forward(policy, inputs, response_length=T).logits, Q, T)
            ours = trainer._logprobs(logits, rollout.response)
    finally:
        del policy.generate
    theirs = torch.log_softmax(captured["scores"].float(), dim=-1).gather(-1, rollout.response.unsqueeze(-1))[..., 0]
    mask = rollout.response_mask()
    if padded:  # prompts of different lengths: left padding
        assert len(set(rollout.query_mask.sum(dim=1).tolist())) > 1
    assert mask.sum() > len(rows)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # rotary and absolute positions
def test_forward_logprobs_equal_the_sampling_distribution_text(tmp_path, kind):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    args = ppo_args(tmp_path, temperature=0.7, response_length=6)
    model = tiny_models.tiny_llama(tokenizer) if kind == "llama" else tiny_models.tiny_gpt2(tokenizer)
    trainer = PPOTrainer(model, WordCount(), args, text_dataset(), processing_class=tokenizer)
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in (PROMPT, "Tell me a story.", "The sea was blue.")]
    sampling_logprobs_agree(trainer, rows)


def test_forward_logprobs_equal_the_sampling_distribution_vlm(tmp_path, vlm):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    processor = AutoProcessor.from_pretrained(vlm["dir"])
    processor.chat_template = tiny_models.LLAVA_CHAT_TEMPLATE
    model = AutoModelForImageTextToText.from_pretrained(vlm["dir"])
    dataset = vlm_dataset(vlm["images"])
    trainer = PPOTrainer(model, WordCount(), ppo_args(tmp_path, temperature=0.7, response_length=6), dataset,
                         processing_class=processor)
    assert trainer.adapter.suppressed == (processor.tokenizer.convert_tokens_to_ids("<image>"),)
    sampling_logprobs_agree(trainer, [dict(dataset[k]) for k in range(3)])


def test_select_multimodal_cuts_images_per_sequence():
    from storyrl.training.storyteller.rl.ppo.rollout import select_multimodal

    pixel = torch.arange(5).float().view(5, 1, 1)  # 5 images: sequences own 2, 1, 2 of them
    sizes = torch.arange(10).view(5, 2)
    tokens = torch.ones(3, 4, dtype=torch.long)
    out = select_multimodal({"pixel_values": pixel, "image_sizes": sizes, "token_type_ids": tokens}, [2, 1, 2],
                            [2, 0], (3, 4), response_width=3)
    assert out["pixel_values"].flatten().tolist() == [3.0, 4.0, 0.0, 1.0]
    assert out["image_sizes"].tolist() == [[6, 7], [8, 9], [0, 1], [2, 3]]
    assert out["token_type_ids"].tolist() == [[1, 1, 1, 1, 0, 0, 0]] * 2


def test_truncate_responses_after_the_stop_token():
    from storyrl.training.storyteller.rl.ppo.rollout import truncate_responses

    response = torch.tensor([[5, 7, 2, 9, 2], [5, 6, 7, 8, 9], [2, 4, 4, 4, 4]])
    cut, lengths, ended = truncate_responses(response, stop_token_id=2, pad_token_id=0)
    assert cut.tolist() == [[5, 7, 2, 0, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]]
    assert lengths.tolist() == [3, 5, 1] and ended.tolist() == [True, False, True]
    same, lengths, ended = truncate_responses(response, stop_token_id=None, pad_token_id=0)
    assert torch.equal(same, response) and lengths.tolist() == [5, 5, 5] and not ended.any()


# -- masking, value model, KL control -----------------------------------------------------------------


class FailsOnOne:
    """Raises whenever its batch contains story s1: PPO must score the others
    one by one and mask s1."""

    __name__ = "fragile"

    def __call__(self, prompts, completions, story_id, **kwargs):
        if "s1" in story_id:
            raise RuntimeError("cannot score story s1")
        return [1.0] * len(completions)


def test_a_reward_that_raises_for_one_completion_masks_it(tmp_path):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), [FailsOnOne()], ppo_args(tmp_path),
                         text_dataset(), processing_class=tokenizer)
    result = trainer.train()
    for record in result.history:  # 4 rows per step: every step holds s1 once
        assert record["ppo/masked_frac"] == pytest.approx(0.25)
        assert record["rewards/fragile/errors"] == 1.0 and record["rewards/fragile/mean"] == 1.0
        assert math.isfinite(record["loss/policy"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fp16 path is for machines without CUDA")
def test_mixed_precision_fp16_without_cuda_is_fp16_autocast_with_a_grad_scaler(tmp_path):
    """fp16 is taken as asked on the CPU too (storyrl.training.accelerators),
    never coerced to fp32; how close it is to fp32: test_rl_precision.py."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), WordCount(), ppo_args(tmp_path, mixed_precision="fp16"),
                         text_dataset(), processing_class=tokenizer)
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is not None
    result = trainer.train(progress=False)
    assert result.steps == 2 and all(math.isfinite(r["loss/policy"]) for r in result.history)


def test_a_reward_that_fails_for_every_completion_is_an_error(tmp_path):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    def broken(prompts, completions, **kwargs):
        raise KeyError("no model")

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), broken, ppo_args(tmp_path), text_dataset(),
                         processing_class=tokenizer)
    with pytest.raises(RuntimeError, match="reward 'broken' failed for every completion"):
        trainer.train()


def test_missing_eos_penalty_then_score_clip(tmp_path, monkeypatch):
    from storyrl.training.storyteller.rl.ppo import math as ppo_math
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    seen, rollouts = [], []
    token_rewards = ppo_math.token_rewards
    monkeypatch.setattr(ppo_math, "token_rewards", lambda kl, scores, mask, c: (seen.append(scores.clone()),
                                                                               token_rewards(kl, scores, mask, c))[1])
    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    # "." ends a response here (stop_token_id), and the model likes it enough to end some of them in 3 tokens
    args = ppo_args(tmp_path, missing_eos_penalty=2.0, score_clip=0.5, max_steps=1, response_length=3,
                    stop_token_id=tokenizer.convert_tokens_to_ids("."))
    trainer = PPOTrainer(likes_full_stops(tiny_models.tiny_llama(tokenizer), tokenizer), lambda
                         prompts, completions, **kw: [1.0] * len(completions), args, text_dataset(),
                         processing_class=tokenizer)
    rollout = trainer.adapter.rollout
    monkeypatch.setattr(trainer.adapter, "rollout", lambda *a: rollouts.append(rollout(*a)) or rollouts[-1])
    trainer.train()
    ended = rollouts[0].ended
    assert 0 < int(ended.sum()) < len(ended)  # both kinds in the batch
    # 1 − 2 for a response cut by response_length, then clipped to ±0.5
    assert seen[0].tolist() == [0.5 if e else -0.5 for e in ended.tolist()]


def test_separate_value_model(tmp_path):
    from transformers import LlamaForSequenceClassification

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    policy = tiny_models.tiny_llama(tokenizer)
    value_config = policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1})
    torch.manual_seed(1)
    value_model = LlamaForSequenceClassification(value_config)
    before = snapshot(value_model)
    trainer = PPOTrainer(policy, WordCount(), ppo_args(tmp_path), text_dataset(), processing_class=tokenizer,
                         value_model=value_model)
    result = trainer.train()
    check_history(result, ["word_count"])
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.value_head is None
    moved = changed(before, snapshot(wrapper.value_model))
    assert "score.weight" in moved and any("layers.0" in k for k in moved)


def test_adaptive_kl_follows_the_controller_and_early_stopping_stops(tmp_path):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    args = ppo_args(tmp_path, adaptive_kl=True, kl_coef=0.2, target=0.01, horizon=20, early_stopping=True,
                    target_kl=1e-6, num_ppo_epochs=4, learning_rate=1e-2, max_steps=3, kl_estimator="k3")
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), WordCount(), args, text_dataset(),
                         processing_class=tokenizer)
    history = trainer.train().history
    coef = 0.2
    for record in history:
        assert record["objective/kl_coef"] == pytest.approx(coef)
        error = min(max(record["objective/kl"] / 0.01 - 1, -0.2), 0.2)
        coef *= 1 + error * 4 / 20
    assert trainer.kl_ctl.value == pytest.approx(coef)
    # step 1 samples from the reference itself (KL 0 < target: the coefficient falls); later steps move away
    assert history[0]["objective/kl"] == 0.0 and history[1]["objective/kl_coef"] == pytest.approx(0.2 * 0.96)
    assert any(r["objective/kl"] > 0.012 for r in history[1:])
    # the first minibatch sees the rollout policy itself (KL 0) and is applied; the next one exceeds 1.5e-6
    for record in history:
        assert record["ppo/early_stopped"] == 1.0 and record["ppo/updates"] == 1.0


# -- resume -----------------------------------------------------------------------------------------------


class CrashesAtCall:
    """WordCount that raises KeyboardInterrupt at call ``n`` (an interrupted run)."""

    __name__ = "word_count"

    def __init__(self, n=None) -> None:
        self.n, self.count = n, 0

    def __call__(self, prompts, completions, **kwargs):
        self.count += 1
        if self.count == self.n:
            raise KeyboardInterrupt
        return [len(c[0]["content"].split()) / 10 for c in completions]


def test_resume_equals_an_uninterrupted_run(tmp_path):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)

    def run(out, reward, resume=False):
        args = ppo_args(tmp_path, output_dir=str(out), save_steps=1, use_score_scaling=True, use_score_norm=True,
                        adaptive_kl=True, target=0.01, horizon=10)
        trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), reward, args, text_dataset(6),
                             processing_class=tokenizer)
        return trainer, trainer.train(resume=resume)

    straight, straight_result = run(tmp_path / "a", CrashesAtCall())
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", CrashesAtCall(n=2))
    assert (tmp_path / "b" / "checkpoint-1").is_dir() and not (tmp_path / "b" / "checkpoint-2").exists()
    resumed, resumed_result = run(tmp_path / "b", CrashesAtCall(), resume=True)

    assert resumed_result.steps == 2
    a = snapshot(straight.accelerator.unwrap_model(straight.model))
    b = snapshot(resumed.accelerator.unwrap_model(resumed.model))
    assert changed(a, b) == set()  # policy and value head
    assert resumed.kl_ctl.value == straight.kl_ctl.value and resumed.moments == straight.moments
    drop = ("time/", "samples")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(drop)}  # noqa: E731
    assert [strip(r) for r in resumed_result.history] == [strip(r) for r in straight_result.history]
    lines = (tmp_path / "b" / "history.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run(tmp_path / "c", CrashesAtCall(), resume=True)


# -- TAPM -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tapm(tmp_path_factory):
    from storyrl.generators.tapm.features import FeatureExtractor, write_features

    root = tmp_path_factory.mktemp("tapm")
    paths = tiny_models.write_images(root / "img", n=5)
    write_features(root / "features", [(p.stem, str(p)) for p in paths],
                   FeatureExtractor("test_resnet", pretrained=False, device="cpu"), batch_size=5)
    return {"features": str(root / "features"), "decoder": tiny_models.save_tiny_decoder(root / "gpt2")}


def tapm_model(tapm, lora=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureStore
    from storyrl.generators.tapm.model import TapmModel

    tokenizer = AutoTokenizer.from_pretrained(tapm["decoder"])
    store = FeatureStore(tapm["features"])
    decoder = AutoModelForCausalLM.from_pretrained(tapm["decoder"])
    lora_options = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "lora_dropout": 0.0,
                    "fan_in_fan_out": True} if lora else None
    model = TapmModel.from_decoder(decoder, tokenizer, {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, seed=0, lora=lora_options)
    return model, tokenizer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tapm_policy_two_steps_credits_every_sentence_with_the_story_score(tmp_path, tapm, monkeypatch, lora):
    from datasets import Dataset

    from storyrl.training.storyteller.rl.ppo import math as ppo_math
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    seen = []
    token_rewards = ppo_math.token_rewards

    def spy(kl, scores, mask, kl_coef):
        seen.append(scores.clone())
        return token_rewards(kl, scores, mask, kl_coef)

    monkeypatch.setattr(ppo_math, "token_rewards", spy)
    model, tokenizer = tapm_model(tapm, lora)
    initial = snapshot(model)
    ids = [["img0", "img1", "img2"], ["img1", "img2", "img3", "img4"], ["img4", "img0", "img1"],
           ["img2", "img3", "img4", "img0"]]
    dataset = Dataset.from_dict({"prompt": [""] * 4, "image_ids": ids, "story_id": [f"t{k}" for k in range(4)]})

    class StoryReward:
        __name__ = "story_reward"

        def __init__(self):
            self.calls = []

        def __call__(self, prompts, completions, image_ids, **kwargs):
            scores = [len(c.split()) + 0.1 * k for k, c in enumerate(completions)]
            self.calls.append((scores, [len(i) for i in image_ids]))
            return scores

    reward = StoryReward()
    args = ppo_args(tmp_path, tapm_features=tapm["features"], response_length=6)
    trainer = PPOTrainer(model, reward, args, dataset, processing_class=tokenizer)
    result = trainer.train()
    check_history(result, ["story_reward"])
    # one sequence per sentence (image), story-major; each gets its story's score at its end
    assert len(seen) == len(reward.calls) == 2
    for sequence_scores, (story_scores, sentences) in zip(seen, reward.calls):
        expected = [s for s, n in zip(story_scores, sentences) for _ in range(n)]
        assert sequence_scores.tolist() == pytest.approx(expected)
    assert all(r["story/tokens_mean"] > 0 for r in result.history)
    moved = changed(initial, snapshot(trainer.policy))
    assert any(k.startswith("visual.") for k in moved)  # the visual encoder trains
    if lora:
        assert not any(k.startswith("decoder.") and "lora_" not in k for k in moved)
        assert any("lora_B" in k for k in moved)
        assert changed({k: v for k, v in initial.items() if k.startswith("visual.")},
                       {f"visual.{k}": v for k, v in snapshot(trainer.ref_model).items()}) == set()
    else:
        assert any(k.startswith("decoder.") for k in moved)
        assert changed(initial, snapshot(trainer.ref_model)) == set()


def test_forward_logprobs_equal_the_sampling_distribution_tapm(tmp_path, tapm):
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    model, tokenizer = tapm_model(tapm)
    rows = [{"prompt": "", "image_ids": ["img0", "img1", "img2"]}, {"prompt": "", "image_ids": ["img3", "img4"]}]
    args = ppo_args(tmp_path, tapm_features=tapm["features"], temperature=0.7, response_length=6)
    trainer = PPOTrainer(model, WordCount(), args, rows * 2, processing_class=tokenizer)
    sampling_logprobs_agree(trainer, rows, padded=False)  # the visual prefix recomputed with grad = generate()'s


def test_config_problems():
    with pytest.raises(ValueError, match="divisible by num_mini_batches"):
        PPOConfig(per_device_train_batch_size=6, num_mini_batches=4)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        PPOConfig(per_device_train_batch_size=4, num_mini_batches=2, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="unknown tracker"):
        PPOConfig(report_to=["tensorbored"])
    with pytest.raises(ValueError, match="use_score_norm needs use_score_scaling"):
        PPOConfig(use_score_norm=True)
    with pytest.raises(TypeError, match="kl_coef"):
        PPOConfig(kl_coef="0.1")
    assert PPOConfig(report_to=["all"]).trackers == ["all"]
    assert PPOConfig().trackers == []


def test_trackers_are_accelerates_log_with(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if installed
    assert PPOConfig(report_to=["tensorboard", "wandb"]).trackers == ["tensorboard", "wandb"]
