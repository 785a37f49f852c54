"""Every storyteller trainer's output is every other's input (issue 31.1):
SFT -> DPO -> RL, SFT -> RL and DPO -> RL, with the policy saved as full
weights, merged LoRA or LoRA adapters (``lora.merge: false``).

Each edge is checked against a reference built by hand with peft (adapters
applied on their recorded base, unmerged, recursively), independent of
storyrl's loader:

* the loaded start policy equals the saved one (same logits);
* the trainer trains it: the saved ``final/`` differs from the start
  (KL(final || start) > 0 on a fixed text) and, read back by hand on the
  start policy, equals what storyrl loads (adapters record their start
  directory as base, so nothing of the chain is lost);
* saving works with the peft that installs (transformers' own peft
  integration demands a newer one, and used to be reached through
  ``AutoModel*.from_pretrained`` on an adapter directory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import TAPM_TEXTS, save_tiny_chat_vlm, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."
TEXTS = [*TAPM_TEXTS, P1.format(n="three"), P1.format(n="four")]
PROBE = "the dog ran to the park . my family had a big party ."
LORA = {"enabled": True, "r": 4, "alpha": 8}

pytestmark = pytest.mark.usefixtures("trl_offline")


def _sft(assets, name, start, lora):
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    config = SFTRunConfig.from_mapping({
        "model": start, "data": assets["data"], "output_dir": str(assets["root"] / name), "prompt": "P1",
        "max_steps": 1, "batch_size": 2, "learning_rate": 5e-2, "seed": 0, "lora": lora})
    return train(config, progress=False).final_dir


def _dpo(assets, name, start, lora):
    from storyrl.training.storyteller.dpo import DPORunConfig, train

    config = DPORunConfig.from_mapping({
        "model": start, "data": assets["data"], "pairs": assets["pairs"], "output_dir": str(assets["root"] / name),
        "prompt": "P1", "max_steps": 1, "batch_size": 2, "learning_rate": 5e-2, "seed": 0, "lora": lora})
    return train(config, progress=False).final_dir


def _rl(assets, name, start, algorithm, lora):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.train import train

    if algorithm == "ppo":
        section = {"per_device_train_batch_size": 2, "num_ppo_epochs": 1, "response_length": 6,
                   "learning_rate": 5e-2, "temperature": 1.0}
    else:
        section = {"per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 6,
                   "learning_rate": 5e-2, "beta": 0.1, "save_strategy": "no", "gradient_checkpointing": False, "logging_steps": 1,
                   "temperature": 1.0}
    config = RLConfig.from_mapping({
        "algorithm": algorithm, "model": start, "data": assets["data"], "output_dir": str(assets["root"] / name),
        "rewards": ["rouge_l"], "max_steps": 2, "prompt": "P1", "seed": 0, "lora": lora, algorithm: section})
    train(config, progress=False)
    # The reference is the start policy (KL 0 at the first step), and the
    # policy moves away from it (KL > 0 at the second).
    history = [json.loads(line) for line in (assets["root"] / name / "history.jsonl").read_text().splitlines()]
    kls = [entry["objective/kl" if algorithm == "ppo" else "kl"] for entry in history
           if ("objective/kl" if algorithm == "ppo" else "kl") in entry]
    assert len(kls) == 2 and abs(kls[0]) < 1e-6 and abs(kls[1]) > 1e-7, kls
    return str(assets["root"] / name / "final")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("handoff")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k:k + 2]),
                                        "images": images}) + "\n" for k in range(4)), encoding="utf-8")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": P1.format(n="three"), "chosen": " ".join(TAPM_TEXTS[k:k + 2]),
                                         "rejected": TAPM_TEXTS[4 - k], "images": images, "story_id": f"s{k}"})
                             + "\n" for k in range(2)), encoding="utf-8")
    assets = {"root": root, "data": str(data), "pairs": str(pairs), "base": save_tiny_llama(root / "base", TEXTS)}
    # The producers: SFT three ways, DPO on SFT adapters two ways.
    assets["sft_full"] = _sft(assets, "sft_full", assets["base"], {"enabled": False})
    assets["sft_merged"] = _sft(assets, "sft_merged", assets["base"], {**LORA, "merge": True})
    assets["sft_adapters"] = _sft(assets, "sft_adapters", assets["base"], {**LORA, "merge": False})
    assets["dpo_adapters"] = _dpo(assets, "dpo_adapters", assets["sft_adapters"], {**LORA, "merge": False})
    assets["dpo_merged"] = _dpo(assets, "dpo_merged", assets["sft_adapters"], {**LORA, "merge": True})
    return assets


# -- the reference: peft by hand ------------------------------------------------------------


def hand_policy(path: str, vlm: bool = False, auto_class=None, **kwargs):
    """The policy saved in ``path`` built by hand: full weights, or LoRA
    adapters added to their recorded base's weights as W + (alpha / r) B A,
    read from the saved files, recursively (no peft involved); a module
    saved whole beside the adapters (a reward model's score head) replaces
    the base's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_class = auto_class or (AutoModelForImageTextToText if vlm else AutoModelForCausalLM)
    adapter = Path(path) / "adapter_config.json"
    if not adapter.is_file():
        return auto_class.from_pretrained(path, **kwargs).eval()
    meta = json.loads(adapter.read_text(encoding="utf-8"))
    model = hand_policy(meta["base_model_name_or_path"], vlm, auto_class, **kwargs)
    saved = load_file(str(Path(path) / "adapter_model.safetensors"))
    weights = dict(model.named_parameters())
    pairs = [key[:-len(".lora_A.weight")] for key in saved if key.endswith(".lora_A.weight")]
    whole = [key for key in saved if ".lora_" not in key]
    assert pairs and len(saved) == 2 * len(pairs) + len(whole)
    with torch.no_grad():
        for key in whole:
            weights[key.removeprefix("base_model.model.")].copy_(saved[key])
        for prefix in pairs:
            name = prefix.removeprefix("base_model.model.") + ".weight"
            if name not in weights:  # VLMs: peft keys drop the "model." transformers adds to the language model
                (name,) = [n for n in weights if n.endswith(name.removeprefix("model."))]
            delta = saved[prefix + ".lora_B.weight"] @ saved[prefix + ".lora_A.weight"]
            weights[name] += delta * meta["lora_alpha"] / meta["r"]
    return model


def probe_ids(path: str):
    import torch
    from transformers import AutoTokenizer

    return torch.tensor([AutoTokenizer.from_pretrained(path)(PROBE)["input_ids"]])


def logprobs(model, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.double(), -1)


def kl(p_logp, q_logp) -> float:
    """Mean over positions of KL(p || q)."""
    return float((p_logp.exp() * (p_logp - q_logp)).sum(-1).mean())


def storyrl_policy(path: str, data: str):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import load_policy

    config = RLConfig.from_mapping({"model": path, "data": data, "output_dir": "unused", "rewards": ["rouge_l"],
                                    "prompt": "P1"})
    return load_policy(config)


def check_edge(assets, start: str, final: str, lora: dict, vlm: bool = False) -> None:
    ids = probe_ids(start)
    start_logp = logprobs(hand_policy(start, vlm), ids)
    final_logp = logprobs(hand_policy(final, vlm), ids)
    loaded = storyrl_policy(final, assets["data"]).model.eval()
    assert (logprobs(loaded, ids) - final_logp).abs().max() < 1e-5  # saved = what storyrl loads
    assert kl(final_logp, start_logp) > 1e-7  # it trained
    adapters = Path(final) / "adapter_config.json"
    assert adapters.is_file() == (lora.get("enabled", False) and not lora.get("merge", False))
    from storyrl.training.model_card import is_storyrl_card

    assert is_storyrl_card(Path(final) / "README.md")  # every trainer's library call writes storyrl's card
    if adapters.is_file():
        assert json.loads(adapters.read_text())["base_model_name_or_path"] == start


# -- the edges -------------------------------------------------------------------------------


@pytest.mark.parametrize("producer", ["sft_full", "sft_merged", "sft_adapters", "dpo_adapters", "dpo_merged"])
def test_a_saved_policy_loads_as_it_was_saved(assets, producer):
    ids = probe_ids(assets[producer])
    policy = storyrl_policy(assets[producer], assets["data"])
    assert (logprobs(policy.model.eval(), ids) - logprobs(hand_policy(assets[producer]), ids)).abs().max() < 1e-5
    # It is a plain model whose weights train (peft freezes a base it wraps) ...
    assert type(policy.model).__name__ == "LlamaForCausalLM"
    assert all(p.requires_grad for p in policy.model.parameters())
    # ... and not the base: the producer trained.
    assert kl(logprobs(policy.model, ids), logprobs(hand_policy(assets["base"]), ids)) > 1e-7
    assert policy.tokenizer.padding_side == "left"


@pytest.mark.parametrize("producer", ["sft_full", "sft_merged", "sft_adapters"])
def test_sft_to_dpo(assets, producer):
    final = _dpo(assets, f"dpo_on_{producer}", assets[producer], {**LORA, "merge": False})
    check_edge(assets, assets[producer], final, {**LORA, "merge": False})


def test_sft_adapters_to_dpo_without_lora(assets):
    final = _dpo(assets, "dpo_full_on_adapters", assets["sft_adapters"], {"enabled": False})
    check_edge(assets, assets["sft_adapters"], final, {"enabled": False})


@pytest.mark.parametrize("producer, algorithm, lora", [
    ("sft_adapters", "grpo", {**LORA, "merge": False}),
    ("sft_adapters", "ppo", {**LORA, "merge": False}),
    ("sft_adapters", "rloo", {**LORA, "merge": True}),
    ("sft_adapters", "grpo", {"enabled": False}),
    ("sft_merged", "grpo", {**LORA, "merge": False}),
    ("sft_full", "ppo", {**LORA, "merge": False}),
    ("dpo_adapters", "grpo", {**LORA, "merge": False}),
    ("dpo_adapters", "ppo", {**LORA, "merge": True}),
    ("dpo_adapters", "rloo", {**LORA, "merge": False}),
    ("dpo_merged", "ppo", {**LORA, "merge": False}),
])
def test_sft_or_dpo_to_rl(assets, producer, algorithm, lora):
    name = f"rl_{algorithm}_{'lora' if lora['enabled'] else 'full'}{'_merged' if lora.get('merge') else ''}_on_{producer}"
    final = _rl(assets, name, assets[producer], algorithm, lora)
    check_edge(assets, assets[producer], final, lora)


def test_rl_on_rl_adapters_keeps_the_whole_chain(assets):
    """base <- SFT adapters <- DPO adapters <- GRPO adapters <- PPO adapters."""
    first = _rl(assets, "chain_grpo", assets["dpo_adapters"], "grpo", {**LORA, "merge": False})
    second = _rl(assets, "chain_ppo", first, "ppo", {**LORA, "merge": False})
    check_edge(assets, first, second, {**LORA, "merge": False})


@pytest.fixture(scope="module")
def vlm_sft(assets):
    from storyrl.training.storyteller.sft import SFTRunConfig, train

    root = assets["root"]
    vlm = save_tiny_chat_vlm(root / "vlm", TEXTS)
    sft = train(SFTRunConfig.from_mapping({
        "model": vlm, "data": assets["data"], "output_dir": str(root / "vlm_sft"), "prompt": "P1",
        "max_steps": 1, "batch_size": 2, "learning_rate": 5e-2, "seed": 0, "lora": {**LORA, "merge": False}}),
        progress=False).final_dir
    assert (Path(sft) / "adapter_config.json").is_file()
    return sft


def test_vlm_adapters_are_a_generate_model(vlm_sft):
    """``storyrl generate --model`` (the prompting generator's loader) reads
    a VLM's adapters merged; vLLM, which reads full weights, refuses them."""
    from storyrl.generators.engines import VllmEngine
    from storyrl.models.vlm import load_vlm

    loaded = load_vlm(vlm_sft, device="cpu", precision="fp32")
    ids = probe_ids(vlm_sft)
    assert (logprobs(loaded.model, ids) - logprobs(hand_policy(vlm_sft, vlm=True), ids)).abs().max() < 1e-5
    assert kl(logprobs(loaded.model, ids), logprobs(hand_policy(str(Path(vlm_sft).parents[1] / "vlm"), vlm=True),
                                                  ids)) > 1e-7
    with pytest.raises(ValueError, match=r"backend 'vllm': .* holds LoRA adapters"):
        VllmEngine(vlm_sft, None, None, "fp16", False, None)


def test_vlm_sft_adapters_to_grpo(assets, vlm_sft):
    sft = vlm_sft
    final = _rl({**assets, "data": assets["data"]}, "vlm_grpo", sft, "grpo", {**LORA, "merge": False})
    ids = probe_ids(sft)
    start_logp = logprobs(hand_policy(sft, vlm=True), ids)
    final_logp = logprobs(hand_policy(final, vlm=True), ids)
    assert kl(final_logp, start_logp) > 1e-7
    assert json.loads((Path(final) / "adapter_config.json").read_text())["base_model_name_or_path"] == sft


def test_an_adapter_chain_that_loops_or_names_no_base_is_one_line(tmp_path, assets):
    from storyrl.models.pretrained import load_pretrained

    from transformers import AutoModelForCausalLM

    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(loop)}))
    with pytest.raises(ValueError, match=f"form a loop or a chain longer than 16 \\({loop} -> {loop}\\)"):
        load_pretrained(AutoModelForCausalLM, str(loop))
    nobase = tmp_path / "nobase"
    nobase.mkdir()
    (nobase / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match=r"adapter_config.json: names no base model"):
        load_pretrained(AutoModelForCausalLM, str(nobase))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": assets["base"],
                                                            "peft_type": "LORA", "r": 4}))
    with pytest.raises(ValueError, match=f"{broken}: cannot load the adapters"):
        load_pretrained(AutoModelForCausalLM, str(broken))


@pytest.mark.parametrize("merge", [False, True])
def test_sft_adapters_to_reward_model_and_its_reward(assets, merge):
    """A reward model whose backbone is an SFT final/ of adapters trains on
    the SFT policy's weights, and the ``reward_model`` reward scores with
    what was trained (LoRA adapters over that chain, or merged)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, train

    start = assets["sft_adapters"]
    out = assets["root"] / f"rm_{merge}"
    train(RewardModelRunConfig.from_mapping({
        "model": start, "pairs": assets["pairs"], "output_dir": str(out), "max_steps": 1, "batch_size": 2,
        "learning_rate": 5e-2, "seed": 0, "eval_fraction": 0.0, "max_length": 64, "include_prompt": False,
        "lora": {**LORA, "merge": merge}}), progress=False)
    final = out / "final"
    from storyrl.training.model_card import is_storyrl_card

    assert is_storyrl_card(final / "README.md")
    if not merge:
        assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == start
    # By hand: the SFT policy's transformer (W + (alpha/r) BA) under the trained score head and adapters.
    policy = hand_policy(start)
    hand = hand_policy(str(final), auto_class=AutoModelForSequenceClassification, num_labels=1) if not merge \
        else AutoModelForSequenceClassification.from_pretrained(final).eval()
    if merge:  # the merged backbone is the SFT policy's plus the reward model's own adapters
        assert any((dict(hand.named_parameters())[n] - p).abs().max() > 0
                   for n, p in policy.named_parameters() if n.startswith("model.layers"))
    else:
        body = dict(hand.named_parameters())
        delta = [(body[n] - p).abs().max() for n, p in policy.named_parameters() if n.startswith("model.layers")]
        assert max(delta) > 0
    story = TAPM_TEXTS[0]
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer(story + tokenizer.eos_token, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = hand(input_ids=ids).logits[0, 0].item()
    reward = create_reward("reward_model", model=str(final), device="cpu", precision="fp32")
    assert reward.score([story])[0] == pytest.approx(expected, abs=1e-4)


def test_dpo_adapters_are_a_pairs_policy(assets, tmp_path):
    """``storyrl pairs --policy`` samples from a chain of adapters (SFT ->
    DPO, unmerged); it loads the policy with :func:`load_policy`, whose
    equality with the saved policy the tests above check."""
    from click.testing import CliRunner

    from storyrl.cli import main

    out = tmp_path / "pairs.jsonl"
    result = CliRunner().invoke(main, ["pairs", "--policy", assets["dpo_adapters"], "--data", assets["data"],
                                       "-m", "rouge_l", "-k", "2", "--max-new-tokens", "6", "-o", str(out)])
    assert result.exit_code == 0, result.output
    samples = [json.loads(line) for line in out.with_name(out.stem + ".samples.jsonl").read_text().splitlines()]
    header, *rows = samples
    assert header["options"]["k"] == 2
    assert sorted(row["story_id"] for row in rows) == ["s0", "s1", "s2", "s3"]
    assert all(len(row["samples"]) == 2 for row in rows)


@pytest.mark.parametrize("where", ["adapters", "base"])
def test_a_corrupted_file_anywhere_in_the_chain_is_named(assets, tmp_path, where):
    """load_pretrained checks every local directory of the chain before
    loading (transformers' and peft's errors name no file)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from storyrl.models.pretrained import load_pretrained

    base = tmp_path / "base"
    shutil.copytree(assets["base"], base)
    adapters = tmp_path / "adapters"
    shutil.copytree(assets["sft_adapters"], adapters)
    meta = json.loads((adapters / "adapter_config.json").read_text())
    (adapters / "adapter_config.json").write_text(json.dumps({**meta, "base_model_name_or_path": str(base)}))
    bad = adapters / "adapter_model.safetensors" if where == "adapters" else base / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"^{bad}: not a readable safetensors file"):
        load_pretrained(AutoModelForCausalLM, str(adapters))


def test_adapters_as_a_ppo_value_model(assets):
    """ppo.value_model may be a final/ of adapters: a plain trainable
    sequence classifier whose body is the saved policy's."""
    from storyrl.training.storyteller.rl.ppo.value import load_value_model

    value = load_value_model(assets["dpo_adapters"])
    assert type(value).__name__ == "LlamaForSequenceClassification"
    assert all(p.requires_grad for p in value.parameters())
    hand = hand_policy(assets["dpo_adapters"])
    body = dict(value.named_parameters())
    assert all((body[n] - p).abs().max() < 1e-6 for n, p in hand.named_parameters() if n.startswith("model."))
    assert value.config._name_or_path == value.name_or_path == assets["dpo_adapters"]


def test_adapters_that_do_not_fit_their_base_are_one_line(assets, tmp_path):
    """A base path overwritten by another model: the adapters' directory
    is named, not a bare state-dict error."""
    import shutil

    from transformers import AutoModelForCausalLM

    from storyrl.models.pretrained import load_pretrained

    base = tmp_path / "base"
    wide = tmp_path / "wide"
    save_tiny_llama(wide, TEXTS)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(wide)
    config.hidden_size, config.intermediate_size = 64, 128
    LlamaForCausalLM(config).save_pretrained(base)  # another model where the adapters' base was
    adapters = tmp_path / "adapters"
    shutil.copytree(assets["sft_adapters"], adapters)
    meta = json.loads((adapters / "adapter_config.json").read_text())
    (adapters / "adapter_config.json").write_text(json.dumps({**meta, "base_model_name_or_path": str(base)}))
    with pytest.raises(ValueError, match=f"^{adapters}: cannot load the adapters on {base}: "):
        load_pretrained(AutoModelForCausalLM, str(adapters))


def test_the_adapters_own_tokenizer_wins_and_the_base_revision_is_the_recorded_one(assets, tmp_path):
    import shutil

    from storyrl.models.pretrained import processor_source

    adapters = tmp_path / "adapters"
    shutil.copytree(assets["sft_adapters"], adapters)
    tokenizer_config = json.loads((adapters / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{{ 'edited' }}"
    (adapters / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (adapters / "chat_template.jinja").unlink(missing_ok=True)
    assert processor_source(str(adapters)) == (str(adapters), None)
    assert storyrl_policy(str(adapters), assets["data"]).tokenizer.chat_template == "{{ 'edited' }}"

    # A hub base pinned in adapter_config.json loads at that revision.
    hub = tmp_path / "hub_adapters"
    hub.mkdir()
    (hub / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base", "revision": "abc"}))
    assert processor_source(str(hub)) == ("org/base", "abc")
    seen = {}

    class Auto:
        @staticmethod
        def from_pretrained(name, revision=None, **kwargs):
            seen.update(name=name, revision=revision)
            raise OSError("stop here")

    from storyrl.models.pretrained import load_pretrained

    with pytest.raises(OSError, match="stop here"):
        load_pretrained(Auto, str(hub), revision="caller's")
    assert seen == {"name": "org/base", "revision": "abc"}


def test_new_adapters_record_the_policys_revision(assets):
    from storyrl.training.storyteller.rl.config import RLConfig
    from storyrl.training.storyteller.rl.policy import lora_config

    config = RLConfig.from_mapping({"model": assets["base"], "revision": "abc123", "data": assets["data"],
                                    "output_dir": "unused", "rewards": ["rouge_l"], "prompt": "P1", "lora": LORA})
    assert lora_config(config, "causal_lm").revision == "abc123"
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, _lora

    reward_model = RewardModelRunConfig.from_mapping({"model": assets["base"], "revision": "abc123",
                                                      "pairs": assets["pairs"], "output_dir": "unused",
                                                      "lora": LORA})
    assert _lora(reward_model).revision == "abc123"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_adapter_chain_loads_in_reduced_precision(assets, dtype):
    """The chain merges into a base loaded in fp16/bf16 (the precision
    option's dtype): the weights are that dtype and the logits follow the
    hand-built fp32 policy within the dtype's rounding."""
    import torch
    from transformers import AutoModelForCausalLM

    from storyrl.models.pretrained import load_pretrained

    model = load_pretrained(AutoModelForCausalLM, assets["dpo_adapters"], dtype=getattr(torch, dtype)).eval()
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    ids = probe_ids(assets["dpo_adapters"])
    with torch.no_grad():
        got = torch.log_softmax(model(input_ids=ids).logits.float(), -1).double()
    expected = logprobs(hand_policy(assets["dpo_adapters"]), ids)
    assert (got - expected).abs().max() < (0.05 if dtype == "bfloat16" else 0.01)
