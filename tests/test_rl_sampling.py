"""Rollouts sampled on merged LoRA weights (storyrl.training.storyteller.rl.sampling,
issue 32): the merged model computes what a hand-merged copy computes, the
base weights come back bit for bit, layers that cannot be merged exactly
sample unmerged, and PPO, GRPO and RLOO sample merged unless
``merge_adapters_for_sampling`` is off (a spy on ``generate``)."""

from __future__ import annotations

import copy
import json

import pytest
import tiny_models

import storyrl  # noqa: F401  (torchvision fallback before transformers)

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from storyrl.training.storyteller.rl.sampling import lora_layers, merged_adapters, unmergeable  # noqa: E402

CORPUS = ["The cat sat on the mat. The dog ran to the park.", "Tell me a story about these pictures."]
TARGETS = ["q_proj", "v_proj"]

pytestmark = pytest.mark.usefixtures("trl_offline")


def lora_model(dtype=torch.float32, **options):
    """A tiny LLaMA in ``dtype`` with LoRA on q/v, B drawn at random (peft
    starts it at 0, which would merge nothing); and the base before peft."""
    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    base = tiny_models.tiny_llama(tokenizer).to(dtype)
    plain = copy.deepcopy(base)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, **options)
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model.eval(), plain.eval(), tokenizer


def hand_merged(model, plain):
    """``plain`` with W + (alpha / r) B A at every adapted layer, by hand in
    fp32 and rounded once to the weights' dtype."""
    merged = copy.deepcopy(plain)
    for name, module in merged.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            lora = model.get_submodule(f"base_model.model.{name}")
            a, b = lora.lora_A["default"].weight.float(), lora.lora_B["default"].weight.float()
            with torch.no_grad():
                module.weight.copy_((module.weight.float() + (8 / 4) * b @ a).to(module.weight.dtype))
    return merged


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_merged_sampling_computes_the_hand_merged_model_and_restores_the_base(dtype):
    model, plain, tokenizer = lora_model(dtype)
    ids = torch.tensor([tokenizer("The cat sat on the mat.")["input_ids"]])
    bases = {name: layer.get_base_layer().weight for name, layer in _named_lora(model)}
    saved = {name: (w.data, w.detach().clone()) for name, w in bases.items()}
    unmerged = logits(model, ids)
    reference = hand_merged(model, plain)
    with merged_adapters(model) as merged:
        assert merged and lora_layers(model) == []  # plain linears while sampling
        for name, module in reference.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:  # the weights rounded once, as by hand
                assert torch.equal(model.get_submodule(f"base_model.model.{name}").weight, module.weight)
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=0)
    assert len(lora_layers(model)) == 2 * len(TARGETS)  # 2 layers x q, v
    for name, w in bases.items():  # the very tensors, bit for bit
        original, copy_ = saved[name]
        assert w.data.data_ptr() == original.data_ptr() and torch.equal(w, copy_)
    assert torch.equal(logits(model, ids), unmerged)
    if dtype == torch.float32:  # merged and unmerged are one function up to rounding
        torch.testing.assert_close(logits(reference, ids), unmerged, rtol=1e-5, atol=1e-5)


def _named_lora(model):
    return [(f"{id(parent)}.{attribute}", layer) for parent, attribute, layer in lora_layers(model)]


def test_the_base_comes_back_after_an_error():
    model, _, _ = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), merged_adapters(model):
        raise RuntimeError("boom")
    assert len(lora_layers(model)) == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("case", ["dora", "disabled", "off", "no adapters", "lora_bias", "already merged"])
def test_what_cannot_be_merged_exactly_samples_unmerged(case):
    model, plain, _ = lora_model(use_dora=case == "dora", **({"lora_bias": True} if case == "lora_bias" else {}))
    if case == "dora":
        assert "variant" in unmergeable(lora_layers(model)[0][2])
    if case == "lora_bias":  # lora_B's bias is not in get_delta_weight: merging the weights would drop it
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name and name.endswith("bias"):
                    param.fill_(0.5)
        assert unmergeable(lora_layers(model)[0][2]) == "lora_bias"
    if case == "already merged":  # the base already holds W + delta: merging again would add it twice
        model.merge_adapter()
    if case == "no adapters":
        model = plain
    ids = torch.tensor([[1, 5, 7, 9, 4]])
    want = logits(model, ids)
    before = lora_layers(model)
    context = model.disable_adapter() if case == "disabled" else torch.no_grad()
    with context, merged_adapters(model, enabled=case != "off") as merged:
        assert not merged and lora_layers(model) == before
        if case != "disabled":
            assert torch.equal(logits(model, ids), want)  # sampling sees the policy itself


def test_only_the_active_adapter_is_merged():
    """A second, inactive adapter (a reference or an earlier one) stays out of the sampling weights."""
    model, plain, _ = lora_model()
    model.add_adapter("other", peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.other" in name:
                param.fill_(0.3)
    model.set_adapter("default")
    ids = torch.tensor([[1, 5, 7, 9, 4]])
    want = logits(model, ids)
    with merged_adapters(model) as merged:
        assert merged
        torch.testing.assert_close(logits(model, ids), want, atol=1e-5, rtol=1e-5)


# -- the trainers sample merged --------------------------------------------------------------


@pytest.fixture
def generate_spy(monkeypatch):
    """``lora``: per ``generate`` call, the number of peft LoRA layers in the
    model that samples (0: merged); ``widths``: the token widths of the
    LLaMA forwards inside them (a KV cache feeds one token per decoding
    step after the prompt's)."""
    from types import SimpleNamespace

    from transformers.generation.utils import GenerationMixin
    from transformers.models.llama import modeling_llama

    spy = SimpleNamespace(lora=[], widths=[], inside=0)
    original, forward = GenerationMixin.generate, modeling_llama.LlamaModel.forward

    def generate(self, *args, **kwargs):
        spy.lora.append(len(lora_layers(self)))
        spy.inside += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            spy.inside -= 1

    def recording_forward(self, input_ids=None, *args, **kwargs):
        if spy.inside and input_ids is not None:
            spy.widths.append(input_ids.shape[1])
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", recording_forward)
    return spy


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_ppo_samples_on_merged_weights_and_computes_the_sampled_logprobs(tmp_path, generate_spy, merge):
    """PPO's log-probabilities (the unmerged model's forward) equal the
    scores generate sampled from on the merged weights; the option off
    samples through peft's layers. With activation checkpointing on, the
    decoding still uses the KV cache (one token per forward)."""
    from test_ppo import WordCount, ppo_args, sampling_logprobs_agree, text_dataset

    from storyrl.training.storyteller.rl.ppo import PPOTrainer

    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    args = ppo_args(tmp_path, temperature=0.7, response_length=6, merge_adapters_for_sampling=merge,
                    gradient_checkpointing=True)
    trainer = PPOTrainer(tiny_models.tiny_llama(tokenizer), WordCount(), args, text_dataset(),
                         processing_class=tokenizer,
                         peft_config=peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                                                     task_type="CAUSAL_LM"))
    with torch.no_grad():  # adapters that change the distribution
        for name, param in trainer.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in (CORPUS[1], "Tell me a story.")]
    sampling_logprobs_agree(trainer, rows)
    assert generate_spy.lora == [0 if merge else 4]
    assert len(generate_spy.widths) > 2 and set(generate_spy.widths[1:]) == {1}


@pytest.fixture(scope="module")
def rl_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    images = [str(p) for p in tiny_models.write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": CORPUS[0], "images": images}) + "\n"
                            for k in range(2)))
    return {"data": str(data), "model": tiny_models.save_tiny_llama(root / "llama", tiny_models.TAPM_TEXTS)}


@pytest.mark.parametrize("algorithm,merge", [("grpo", True), ("grpo", False), ("rloo", True)])  # rloo: with GC
def test_grpo_and_rloo_sample_on_merged_weights_and_keep_the_base(rl_assets, tmp_path, generate_spy, algorithm,
                                                                   merge):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    config = RLConfig.from_mapping({
        "algorithm": algorithm, "model": rl_assets["model"], "data": rl_assets["data"], "output_dir": str(tmp_path),
        "rewards": ["bleu"], "max_steps": 1, "prompt": "P1",
        "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": TARGETS},
        "merge_adapters_for_sampling": merge,
        algorithm: {"per_device_train_batch_size": 2, "num_generations": 2, "max_completion_length": 6,
                    "beta": 0.1, "save_strategy": "no", "gradient_checkpointing": algorithm == "rloo"}})
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}

        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.after = dict(model.named_parameters())

    snapshot = Snapshot()
    train(config, progress=False, callbacks=[snapshot])
    assert generate_spy.lora == [0 if merge else 4]  # 2 layers x q_proj, v_proj
    # the KV cache on (rloo: under activation checkpointing)
    assert len(generate_spy.widths) > 2 and set(generate_spy.widths[1:]) == {1}
    # the frozen base: the same parameters, bit for bit
    assert snapshot.before and all(torch.equal(v, snapshot.after[n]) for n, v in snapshot.before.items())


def test_merge_adapters_for_sampling_is_a_run_level_key(rl_assets, tmp_path):
    """Set at the top level (a bool, checked, not coerced), it reaches
    PPO's config; inside an algorithm's section it is refused in one line."""
    from storyrl.config import ConfigError
    from storyrl.training.storyteller.rl.config import RLConfig

    base = {"model": rl_assets["model"], "data": rl_assets["data"], "output_dir": str(tmp_path),
            "rewards": ["bleu"], "prompt": "P1"}
    ppo = RLConfig.from_mapping({**base, "algorithm": "ppo", "merge_adapters_for_sampling": False})
    assert ppo.ppo.merge_adapters_for_sampling is False
    assert RLConfig.from_mapping({**base, "algorithm": "ppo"}).ppo.merge_adapters_for_sampling is True
    grpo = RLConfig.from_mapping({**base, "merge_adapters_for_sampling": False})
    assert grpo.merge_adapters_for_sampling is False and not hasattr(grpo.grpo, "merge_adapters_for_sampling")
    with pytest.raises((TypeError, ConfigError), match="merge_adapters_for_sampling"):
        RLConfig.from_mapping({**base, "merge_adapters_for_sampling": "yes"})
    for algorithm in ("ppo", "grpo"):
        with pytest.raises(ValueError, match=f"{algorithm}: set merge_adapters_for_sampling at the top level"):
            RLConfig.from_mapping({**base, "algorithm": algorithm,
                                   algorithm: {"merge_adapters_for_sampling": False}})
