"""storyrl's PPO trainer (storyrl/training/storyteller/rl/ppo/) number by number
against an independent reference (tests/ppo_reference.py), and on toy tasks
with a known optimum.

(a) Each reference test runs the trainer for a few steps on a tiny
random-weight policy, records its rollouts and reward values, replays them in
the reference (plain loops, float64, unpadded single-sequence forwards, its
own copy of the initial weights and its own AdamW loop) and compares every
logged metric and every parameter after the run. Together the configurations
cover every PPOConfig option that changes the numbers, masked (unscorable)
stories, zero-weight (log-only) rewards, a separate value model with
left-padded prompts and a TAPM policy with LoRA.

(b) Toy tasks: PPO, GRPO and RLOO raise the fraction of a target word; a
larger KL coefficient keeps the policy closer to the reference; a zero-weight
reward changes nothing.
"""

from __future__ import annotations

import math

import pytest

import storyrl  # noqa: F401  (torchvision fallback before transformers)
import tiny_models
from ppo_reference import assert_matches, expected_rows, initial_copy, record, run_reference

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

from storyrl.training.storyteller.rl.ppo.config import PPOConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

CORPUS = ["The cat sat on the mat. The dog ran to the park.", "A dog ran to the park. It played with a red ball.",
          "Tell me a story about these pictures.", "We went to the beach. The sea was blue."]
# prompts of different lengths: left padding in every batch
PROMPTS = ["Tell me a story about these pictures.", "A story.", "Tell me a story about the dog.",
           "The cat sat on the mat. Tell me a story."]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")


def text_rows(n=4):
    return [{"prompt": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}], "story_id": f"s{k}"}
            for k in range(n)]


class Target:
    """The fraction of a completion's tokens that are ``token`` plus a small
    length term (so scores vary); None for the stories in ``masked``."""

    __name__ = "target"

    def __init__(self, token: int, masked=(), length_bonus=0.05) -> None:
        self.token, self.masked, self.bonus = token, set(masked), length_bonus

    def __call__(self, prompts, completions, completion_ids, story_id, **kwargs):
        return [None if sid in self.masked else sum(t == self.token for t in ids) / max(len(ids), 1)
                + self.bonus * len(ids) for ids, sid in zip(completion_ids, story_id)]


class LogOnly:
    """A zero-weight reward: NaN for s2, None for s3, the word count else."""

    __name__ = "log_only"

    def __call__(self, prompts, completions, story_id, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [math.nan if s == "s2" else None if s == "s3" else float(len(t.split()))
                for t, s in zip(texts, story_id)]


def likes(model, tokenizer, words, bias=2.0):
    """An output bias towards ``words`` (some responses then stop at "." and
    the target word is sampled now and then)."""
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        for w in words:
            head.bias[tokenizer.convert_tokens_to_ids(w)] = bias
    model.lm_head = head
    return model


def ppo_args(tmp_path, **options):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_mini_batches=2,
                  gradient_accumulation_steps=2, num_ppo_epochs=2, max_steps=2, response_length=6,
                  learning_rate=5e-3, temperature=1.0, save_steps=None, num_sample_stories=0)
    values.update(options)
    return PPOConfig(**values)


def run_against_reference(trainer):
    initial = initial_copy(trainer)
    recording = record(trainer)
    result = trainer.train(progress=False)
    ref = run_reference(initial, trainer, recording)
    assert_matches(trainer, result.history, ref)
    assert recording.micro_batches == ref.micro_batches  # the same stories in each micro-batch
    return result, recording, ref


# -- (a) number by number ---------------------------------------------------------------------------


def test_text_policy_every_loss_option(tmp_path):
    """vf_coef, both clip ranges, γ, λ, reward and advantage whitening, k1,
    kl_coef, missing_eos_penalty, linear lr over two steps, weight decay,
    gradient clipping, 2 minibatches × 2 micro-batches × 2 PPO epochs,
    temperature; a masked story and a zero-weight reward with NaN/None."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog, stop = tokenizer.convert_tokens_to_ids("dog"), tokenizer.convert_tokens_to_ids(".")
    model = likes(tiny_models.tiny_llama(tokenizer), tokenizer, ["dog", "."])
    args = ppo_args(tmp_path, vf_coef=0.3, cliprange=0.15, cliprange_value=0.05, gamma=0.9, lam=0.8,
                    whiten_rewards=True, whiten_advantages=True, kl_coef=0.3, kl_estimator="k1",
                    missing_eos_penalty=0.5, stop_token_id=stop, lr_scheduler_type="linear", weight_decay=0.1,
                    max_grad_norm=0.5, temperature=0.7)
    trainer = PPOTrainer(model, [Target(dog, masked={"s1"}), LogOnly()], args, text_rows(),
                         processing_class=tokenizer, reward_weights=[1.0, 0.0])
    result, recording, ref = run_against_reference(trainer)
    h = result.history
    assert [r["ppo/masked_frac"] for r in h] == [0.25, 0.25]  # s1 only: the log-only NaN/None mask nothing
    assert all(r["objective/entropy"] > 0 for r in h)
    assert h[1]["objective/kl"] != 0 and h[1]["objective/non_score_reward"] != 0
    assert h[1]["lr"] < h[0]["lr"] == 5e-3
    assert any(r["policy/clipfrac"] > 0 for r in h) and any(r["val/clipfrac"] > 0 for r in h)
    assert 0 < ref.clipped_updates  # max_grad_norm acted
    ended = torch.cat([r.ended for r in recording.rollouts])
    assert 0 < int(ended.sum()) < len(ended)  # the missing-EOS penalty applies to some


def test_score_processing_adaptive_kl_k3_constant_lr_and_data_order(tmp_path):
    """use_score_scaling + use_score_norm + score_clip (running moments over
    scorable stories), k3, the adaptive KL controller, constant lr, no
    advantage whitening, no gradient clipping, 8 prompts a step in 2
    minibatches × 2 micro-batches of 2 stories × 2 PPO epochs, 3 steps over
    12 rows (two passes over the data)."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog = tokenizer.convert_tokens_to_ids("dog")
    rows = text_rows(12)
    args = ppo_args(tmp_path, use_score_scaling=True, use_score_norm=True, score_clip=1.2, kl_estimator="k3",
                    kl_coef=0.5, adaptive_kl=True, target=0.02, horizon=40, lr_scheduler_type="constant",
                    whiten_advantages=False, max_grad_norm=None, per_device_train_batch_size=8, max_steps=3, seed=3)
    trainer = PPOTrainer(likes(tiny_models.tiny_llama(tokenizer), tokenizer, ["dog"]),
                         [Target(dog, masked={"s1", "s4", "s9"}), LogOnly()], args, rows, processing_class=tokenizer,
                         reward_weights=[2.0, 0.0])
    result, recording, ref = run_against_reference(trainer)
    h = result.history
    assert [r["lr"] for r in h] == [5e-3] * 3
    assert all(r["ppo/masked_frac"] > 0 for r in h)
    coefs = [r["objective/kl_coef"] for r in h]
    assert coefs[0] == 0.5 and coefs[1] != coefs[0] and coefs[2] != coefs[1]  # the controller moved it
    # data order: each step's rows follow the seed rule; two passes, each a permutation, not the same one
    ids = [[row["story_id"] for row in step_rows] for step_rows in recording.rows]
    for step, step_ids in enumerate(ids):
        assert step_ids == [r["story_id"] for r in expected_rows(rows, 3, 8, step)]
    flat = [s for step_ids in ids for s in step_ids]
    first, second = flat[:12], flat[12:]
    assert sorted(first) == sorted(second) == sorted(r["story_id"] for r in rows) and first != second
    # the update: every PPO epoch's micro-batches cover each story once, in a new order each epoch
    for batches in recording.micro_batches:
        epochs = [batches[:4], batches[4:]]
        for epoch in epochs:
            assert [len(mb) for mb in epoch] == [2, 2, 2, 2]
            assert sorted(s for mb in epoch for s in mb) == list(range(8))
        assert epochs[0] != epochs[1]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_early_stopping_drops_the_rejected_minibatch(tmp_path, lora):
    """early_stopping with a tiny target_kl: each step applies its first
    minibatch (the rollout policy itself, KL 0) and rejects the second; the
    rejected gradients must not reach the next step's update. With LoRA the
    KL reference is the policy with its adapters disabled."""
    from peft import LoraConfig

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog = tokenizer.convert_tokens_to_ids("dog")
    args = ppo_args(tmp_path, early_stopping=True, target_kl=1e-8, kl_coef=0.1, num_ppo_epochs=3)
    peft = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      lora_dropout=0.0) if lora else None
    trainer = PPOTrainer(likes(tiny_models.tiny_llama(tokenizer), tokenizer, ["dog"]), Target(dog, masked={"s3"}),
                         args, text_rows(), processing_class=tokenizer, peft_config=peft)
    result, _, _ = run_against_reference(trainer)
    for record in result.history:
        assert record["ppo/early_stopped"] == 1.0 and record["ppo/updates"] == 1.0
    # the linear schedule counts applied updates only (12 planned, 1 applied by step 2)
    assert result.history[1]["lr"] == pytest.approx(5e-3 * (1 - 1 / 12))


def test_separate_value_model_with_left_padded_prompts(tmp_path):
    """A GPT2ForSequenceClassification critic beside a GPT-2 policy (learned
    absolute positions: a rotary model would not notice shifted positions);
    prompts of different lengths (left padding): policy and critic must use
    the real positions. Score scaling without normalisation, default γ/λ."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog = tokenizer.convert_tokens_to_ids("dog")
    policy = tiny_models.tiny_gpt2(tokenizer)
    torch.manual_seed(1)
    value_model = GPT2ForSequenceClassification(GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=128, num_labels=1,
        pad_token_id=tokenizer.pad_token_id))
    # The attention's key bias gets an identically zero gradient (softmax is shift-invariant): AdamW would
    # blow its float32 rounding noise up to steps of ~lr that the float64 reference does not take. Frozen.
    for model in (policy, value_model):
        for block in model.transformer.h:
            block.attn.c_attn.bias.requires_grad_(False)
    args = ppo_args(tmp_path, use_score_scaling=True, kl_coef=0.2, vf_coef=0.5)
    trainer = PPOTrainer(policy, Target(dog, masked={"s0"}), args, text_rows(), processing_class=tokenizer,
                         value_model=value_model)
    _, recording, _ = run_against_reference(trainer)
    for rollout in recording.rollouts:
        assert len(set(rollout.query_mask.sum(dim=1).tolist())) > 1  # left padding of different widths
    assert trainer.accelerator.unwrap_model(trainer.model).value_head is None


# -- TAPM with LoRA ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tapm(tmp_path_factory):
    from storyrl.generators.tapm.features import FeatureExtractor, write_features

    root = tmp_path_factory.mktemp("tapm")
    paths = tiny_models.write_images(root / "img", n=5)
    write_features(root / "features", [(p.stem, str(p)) for p in paths],
                   FeatureExtractor("test_resnet", pretrained=False, device="cpu"), batch_size=5)
    return {"features": str(root / "features"), "decoder": tiny_models.save_tiny_decoder(root / "gpt2")}


def tapm_lora_model(tapm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.generators.tapm.features import FeatureStore
    from storyrl.generators.tapm.model import TapmModel

    tokenizer = AutoTokenizer.from_pretrained(tapm["decoder"])
    store = FeatureStore(tapm["features"])
    decoder = AutoModelForCausalLM.from_pretrained(tapm["decoder"])
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "lora_dropout": 0.0, "fan_in_fan_out": True}
    model = TapmModel.from_decoder(decoder, tokenizer, {t: s["dim"] for t, s in store.types.items()},
                                   {t: s["tokens"] for t, s in store.types.items()}, seed=0, lora=lora)
    return model, tokenizer


def test_tapm_lora_policy_reference_keeps_the_initial_visual_encoder(tmp_path, tapm):
    """A TAPM storyteller with LoRA on its decoder: one sequence per
    sentence, each credited with its story's score; the KL reference is the
    decoder without adapters after the *initial* visual encoder, while the
    trained encoder moves (step 2's KL shows the difference)."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    model, tokenizer = tapm_lora_model(tapm)
    ids = [["img0", "img1", "img2"], ["img1", "img2", "img3", "img4"], ["img4", "img0", "img1"], ["img2", "img3"]]
    rows = [{"prompt": "", "image_ids": i, "story_id": f"s{k}"} for k, i in enumerate(ids)]
    dog = tokenizer.convert_tokens_to_ids("dog")
    args = ppo_args(tmp_path, tapm_features=tapm["features"], response_length=5, kl_coef=0.5, temperature=0.8)
    trainer = PPOTrainer(model, [Target(dog, masked={"s2"}, length_bonus=0.1), LogOnly()], args, rows,
                         processing_class=tokenizer, reward_weights=[1.0, 0.0])
    result, recording, _ = run_against_reference(trainer)
    assert all(len(r.lengths) == 12 for r in recording.rollouts)  # 3 + 4 + 3 + 2 sentences
    assert result.history[1]["objective/kl"] != 0


# -- (b) toy tasks with a known optimum ----------------------------------------------------------


def toy_ppo(tmp_path, steps=12, kl_coef=0.05, rewards=None, weights=None, seed=0):
    """PPO on "say dog": reward = the fraction of response tokens that are
    "dog" (optimum 1), 8 prompts per step, 4-token responses, no stop token."""
    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog = tokenizer.convert_tokens_to_ids("dog")
    model = likes(tiny_models.tiny_llama(tokenizer), tokenizer, ["dog"], bias=1.0)
    args = ppo_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=steps,
                    response_length=4, learning_rate=1e-2, kl_coef=kl_coef, stop_token="none", seed=seed)
    rewards = rewards or [Target(dog, length_bonus=0.0)]
    trainer = PPOTrainer(model, rewards, args, text_rows(8), processing_class=tokenizer, reward_weights=weights)
    return trainer, trainer.train(progress=False).history


def test_ppo_raises_the_reward_of_a_toy_task(tmp_path):
    _, history = toy_ppo(tmp_path)
    rewards = [r["reward"] for r in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.25 and last > 0.6 and last > first + 0.4, rewards


def test_a_larger_kl_coef_keeps_the_policy_closer_to_the_reference(tmp_path):
    _, free = toy_ppo(tmp_path / "free", kl_coef=0.0)
    _, held = toy_ppo(tmp_path / "held", kl_coef=1.0)
    late = lambda h: sum(r["objective/kl"] for r in h[-4:]) / 4  # noqa: E731
    assert late(held) < 0.2 * late(free), ([r["objective/kl"] for r in free], [r["objective/kl"] for r in held])
    assert sum(r["reward"] for r in held[-4:]) < sum(r["reward"] for r in free[-4:])  # the price: less reward


def test_a_zero_weight_reward_changes_nothing(tmp_path):
    """A log-only reward (weight 0) that returns NaN/None for some stories:
    the same weights and the same history (its own columns aside), nothing
    masked."""
    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    dog = tokenizer.convert_tokens_to_ids("dog")
    plain, plain_history = toy_ppo(tmp_path / "a", steps=3, rewards=[Target(dog, length_bonus=0.0)])
    logged, logged_history = toy_ppo(tmp_path / "b", steps=3, rewards=[Target(dog, length_bonus=0.0), LogOnly()],
                                     weights=[1.0, 0.0])
    a = plain.accelerator.unwrap_model(plain.model).state_dict()
    b = logged.accelerator.unwrap_model(logged.model).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    own = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "rewards/log_only/"))}  # noqa: E731
    assert [own(r) for r in plain_history] == [own(r) for r in logged_history]
    assert all(r["ppo/masked_frac"] == 0.0 for r in logged_history)
    assert all(r["rewards/log_only/mean"] is not None for r in logged_history)


# -- GRPO and RLOO (TRL, through storyrl.training.storyteller.rl.train) --------------------------------------

TOY_WORDS = {"dog", "cat", "park"}


def _register_toy_reward():
    import numpy as np

    from storyrl.rewards import REWARDS, Reward, register_reward

    if "test_ppo_reference_words" in REWARDS:
        return

    @register_reward()
    class _ToyWords(Reward):
        """The fraction of a story's words in TOY_WORDS (optimum 1)."""

        name = "test_ppo_reference_words"

        def _score_batch(self, stories, **context):
            return np.array([sum(w in TOY_WORDS for w in s.split()) / max(len(s.split()), 1) for s in stories])


@pytest.fixture(scope="module")
def rl_assets(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("rl_toy")
    images = [str(p) for p in tiny_models.write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": "a dog ran .", "images": images}) + "\n"
                            for k in range(8)), encoding="utf-8")
    # the words of the d_HM prompt P1 (configs/prompts/dhm.yaml) for three images, so that the tokenizer knows them
    prompt = ("Write a story using exactly three sentences for this image sequence. "
              "Do not use more than three sentences.")
    return {"data": str(data), "model": tiny_models.save_tiny_llama(root / "llama", [*tiny_models.TAPM_TEXTS, prompt])}


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_grpo_and_rloo_raise_the_reward_of_a_toy_task(rl_assets, tmp_path, algorithm):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    _register_toy_reward()
    section = {"per_device_train_batch_size": 16, "num_generations": 8, "max_completion_length": 4,
               "learning_rate": 1e-2, "lr_scheduler_type": "constant", "beta": 0.0, "logging_steps": 1,
               "save_strategy": "no", "gradient_checkpointing": False}
    config = RLConfig.from_mapping({"algorithm": algorithm, "model": rl_assets["model"], "data": rl_assets["data"],
                                    "output_dir": str(tmp_path / "out"), "rewards": ["test_ppo_reference_words"],
                                    "max_steps": 20, "prompt": "P1", algorithm: section})
    result = train(config, progress=False)
    rewards = [e["reward"] for e in result.history if "reward" in e]
    assert len(rewards) == 20
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.2 and last > 0.7 and last > first + 0.5, rewards
