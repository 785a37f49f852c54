"""benchmarks/rl_generate.py (plain ``generate`` next to an RL step's
generation phase) and rl_step.py's options for it, on a tiny LLaMA without
any trainer: what is recorded, what a replay runs, the variants, the RNG
left as it was, and the paired ratios against a hand computation."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import tiny_models

import storyrl  # noqa: F401  (torchvision fallback before transformers)

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rl_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")
CORPUS = ["the red dog ran to the park .", "tell me a story ."]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = tiny_models.chat_tokenizer(CORPUS)
    model = tiny_models.tiny_llama(tokenizer).eval()
    ids = torch.tensor([[5, 6, 7, 8], [0, 5, 9, 10]])
    return model, tokenizer, ids, (ids != 0).long()


def rl_call(model, ids, mask, new=5, temperature=0.7):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=3, max_new_tokens=new, pad_token_id=0,
                              eos_token_id=[1])
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


def test_the_recorder_keeps_the_outermost_call_and_replays_exactly_its_steps(tiny):
    model, _, ids, mask = tiny
    recorder = rl_generate.GenerateRecorder(warmup=0, repeats=2)
    recorder.next_step()
    with recorder.recording():
        out = rl_call(model, ids, mask)
    [call] = recorder.calls
    assert call["step"] == 0 and call["rows"] == 2 and call["prompt_width"] == 4
    assert call["decoding_steps"] == out.shape[1] - 4 and call["seconds"] > 0
    assert torch.equal(call["inputs"]["attention_mask"], mask)
    assert call["sampling"]["temperature"] == 0.7 and call["sampling"]["top_k"] == 3
    config = rl_generate.replay_config(call, 7)
    # the RL call's sampling, a fixed number of decoding steps, no EOS stop, the cache on
    assert (config.temperature, config.top_k, config.max_new_tokens, config.eos_token_id, config.use_cache) == \
        (0.7, 3, 7, [], True)
    assert rl_generate.replay(model, call, new_tokens=7) > 0  # made exactly 7 steps (checked inside)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_step_done_replays_each_variant_and_leaves_the_rng(tiny, lora):
    model, _, ids, mask = tiny
    if lora:
        import copy

        model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.train()
    recorder = rl_generate.GenerateRecorder(warmup=1, repeats=2)
    with recorder.recording():
        for _ in range(3):
            recorder.next_step()
            rl_call(model, ids, mask)
            torch.manual_seed(11)
            recorder.step_done(model)
            after_replays = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(torch.rand(3), after_replays)  # the replays did not move the RNG
    assert len(recorder.calls) == 3  # replays are not recorded
    assert sorted(recorder.replays) == [1, 2]  # the warm-up step is not replayed
    variants = {"unmerged", "merged"} if lora else {"plain"}
    assert all(set(r) == variants for r in recorder.replays.values())
    assert model.training  # put back as it was
    if lora:
        from storyrl.training.storyteller.rl.sampling import lora_layers

        assert len(lora_layers(model)) == 2  # the merged replays left the adapters in place
    phases = [0.3, 0.2]
    out = rl_generate.summary(recorder, phases)
    reference = "merged" if lora else "plain"
    assert out["reference"] == reference and out["steps"] == 2
    ref = [recorder.replays[s][reference] for s in (1, 2)]
    assert out["generation_over_generate"] == pytest.approx(statistics.median([0.3 / ref[0], 0.2 / ref[1]]))
    calls = [recorder.step_calls(s)[0] for s in (1, 2)]
    tokens = [c["rows"] * c["decoding_steps"] for c in calls]
    assert out["tokens"] == tokens
    assert out["ms_per_token"]["generation"] == pytest.approx(1e3 * statistics.median(
        [0.3 / tokens[0], 0.2 / tokens[1]]))
    assert out["generate_call_over_generate"] == pytest.approx(statistics.median(
        [c["seconds"] / r for c, r in zip(calls, ref)]))
    if lora:
        unmerged = [recorder.replays[s]["unmerged"] for s in (1, 2)]
        assert out["unmerged_over_merged"] == pytest.approx(statistics.median(
            [u / m for u, m in zip(unmerged, ref)]))
        assert out["generation_over_generate_unmerged"] == pytest.approx(statistics.median(
            [0.3 / unmerged[0], 0.2 / unmerged[1]]))


def test_adapters_that_cannot_be_swapped_are_merged_after_the_run(tiny, monkeypatch):
    import copy

    model, _, ids, mask = tiny
    model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    monkeypatch.setattr("storyrl.training.storyteller.rl.sampling.unmergeable",
                        lambda layer: "a 4-bit base (pretended)")
    recorder = rl_generate.GenerateRecorder(warmup=0, repeats=1)
    with recorder.recording():
        recorder.next_step()
        rl_call(model, ids, mask)
        recorder.step_done(model)
    assert set(recorder.replays[0]) == {"unmerged"}
    recorder.merged_after_run(model)
    assert recorder.replays[0]["merged"] > 0
    out = rl_generate.summary(recorder, [0.1])
    assert out["reference"] == "merged" and out["merged_after_run"]


def test_no_timed_generate_is_an_error_entry():
    recorder = rl_generate.GenerateRecorder(warmup=1)
    assert "error" in rl_generate.summary(recorder, [0.1])


def test_rl_step_options_reach_the_rl_config(monkeypatch, tmp_path):
    import rl_step

    from storyrl.training.storyteller.rl.config import RLConfig

    seen = []
    monkeypatch.setattr(RLConfig, "from_mapping", classmethod(lambda cls, mapping: seen.append(mapping)))
    assets = {"policy": "p", "data": "d", "rewards": {"repetition": ["repetition"]}}
    for argv in ([], ["--lora", "off", "--gradient-checkpointing", "--merge-adapters-for-sampling", "off"]):
        args = rl_step.parse_args(argv)
        assert args.algorithms == ["ppo", "grpo", "rloo"]
        for algorithm in args.algorithms:
            rl_step.rl_config(assets, args, "repetition", algorithm, tmp_path)
    on, off = seen[:3], seen[3:]
    assert all(m["lora"]["enabled"] and m["merge_adapters_for_sampling"] for m in on)
    assert all("lora" not in m and m["merge_adapters_for_sampling"] is False for m in off)
    assert [m[a]["gradient_checkpointing"] for m, a in zip(on + off, ["ppo", "grpo", "rloo"] * 2)] == \
        [False] * 3 + [True] * 3
    assert off[2]["rloo"]["beta"] == 0.04 and off[2]["rloo"]["num_generations"] == 4
    with pytest.raises(SystemExit):
        rl_step.parse_args(["--algorithms", "ppo,dpo"])
    with pytest.raises(SystemExit):
        rl_step.parse_args(["--generate-repeats", "0"])
