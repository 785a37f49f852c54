"""storyrl train reward_model and the reward_model reward: Bradley-Terry loss
by hand, a separable toy preference learnt (held-out accuracy 1), the
reward's scores = a forward pass, options and errors, storyrl pairs rows in
meta-eval pairs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_models import save_tiny_llama

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

PROMPT = "Write a story about this sequence of images."
SUBJECTS = ["the dog", "a cat", "the man", "my mom", "our team", "the bird", "a girl", "the kids"]
TEXTS = [PROMPT, *[f"{s} was good and happy ." for s in SUBJECTS], *[f"{s} was bad and sad ." for s in SUBJECTS],
         "we went home .", "a long day at the park with the dog ."]


def good(subject: str) -> str:
    return f"{subject} was good and happy ."


def bad(subject: str) -> str:
    return f"{subject} was bad and sad ."


pytestmark = pytest.mark.usefixtures("trl_offline")


def write_pairs(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def pair(k: int, subject: str, prompt: str = PROMPT, **extra) -> dict:
    return {"prompt": prompt, "chosen": good(subject), "rejected": bad(subject), "images": [],
            "story_id": f"s{k}", "source": "toy", "chosen_score": 1.0, "rejected_score": 0.0, "margin": 1.0, **extra}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    rows = [pair(k, s) for k, s in enumerate(SUBJECTS)]
    return {"model": save_tiny_llama(root / "llama", TEXTS, chat=False),
            "pairs": write_pairs(root / "pairs.jsonl", rows), "rows": rows, "root": root}


def options(assets, out, **extra):
    return {"model": assets["model"], "pairs": assets["pairs"], "output_dir": str(out), "max_steps": 1,
            "batch_size": 8, "learning_rate": 5e-3, "logging_steps": 1, "seed": 0, "eval_fraction": 0.0,
            "max_length": 64, **extra}


def config_of(assets, out, **extra):
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig

    return RewardModelRunConfig.from_mapping(options(assets, out, **extra))


def hand_ids(tokenizer, story: str, prompt: str | None, max_length: int = 64) -> list[int]:
    # prompt, a space, the story, then the EOS token TRL appends; cut at max_length
    text = (prompt + " " + story if prompt is not None else story) + tokenizer.eos_token
    return tokenizer(text)["input_ids"][:max_length]


def logit(model, ids: list[int]) -> float:
    import torch

    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


SEED = 2


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """A run that holds 2 of 8 sequences out and learns good > bad."""
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, train

    out = tmp_path_factory.mktemp("run") / "out"
    # seed 2: a fresh head that orders every pair wrongly, so all right afterwards is learnt
    config = RewardModelRunConfig.from_mapping(options(assets, out, max_steps=25, batch_size=6, eval_fraction=0.25,
                                                       logging_steps=5, seed=SEED))
    return train(config, progress=False)


# -- training -----------------------------------------------------------------------------


def test_one_step_loss_is_the_bradley_terry_loss_of_a_forward_pass(assets, tmp_path):
    import torch

    from storyrl.training.storyteller.reward_model import load_backbone, train

    config = config_of(assets, tmp_path / "out")
    model, tokenizer = load_backbone(config)  # the same seed: the same fresh score head
    model.eval()
    chosen = torch.tensor([logit(model, hand_ids(tokenizer, r["chosen"], PROMPT)) for r in assets["rows"]])
    rejected = torch.tensor([logit(model, hand_ids(tokenizer, r["rejected"], PROMPT)) for r in assets["rows"]])
    want = float(-torch.log(torch.sigmoid(chosen - rejected)).mean())
    result = train(config, progress=False)  # one step over all 8 pairs: the logged loss is before the update
    losses = [e["loss"] for e in result.history if "loss" in e]
    assert losses == [pytest.approx(want, rel=1e-4)]
    assert math.isclose(want, math.log(2), rel_tol=0.5)  # random head: near log 2, not a degenerate 0


def test_a_separable_preference_is_learnt_and_held_out_pairs_are_all_right(trained, assets, tmp_path):
    from storyrl.training.storyteller.reward_model import load_backbone, pair_accuracy, read_pairs

    assert trained.heldout_pairs == 2 and trained.heldout_accuracy == 1.0
    # Before training the fresh head of this seed orders every pair wrongly (the check can fail).
    model, tokenizer = load_backbone(config_of(assets, tmp_path / "o", seed=SEED))
    assert pair_accuracy(model, tokenizer, read_pairs(assets["pairs"]), PROMPT, 64) == 0.0
    summary = trained.summary()
    assert summary["heldout_accuracy"] == 1.0 and summary["steps"] == 25
    losses = [e["loss"] for e in trained.history if "loss" in e]
    assert losses[-1] < losses[0]
    lines = [json.loads(x) for x in (Path(trained.output_dir) / "history.jsonl").read_text().splitlines()]
    assert lines[-1] == {"heldout_pairs": 2, "heldout_accuracy": 1.0, "step": 25}
    held = [json.loads(x) for x in (Path(trained.output_dir) / "heldout_pairs.jsonl").read_text().splitlines()]
    assert len(held) == 2 and all(r["chosen"].endswith("good and happy .") for r in held)
    metadata = json.loads((Path(trained.final_dir) / "storyrl_reward_model.json").read_text())
    assert metadata["max_length"] == 64 and metadata["prompt"] == PROMPT and metadata["include_prompt"] is True


def test_split_is_by_story_id_seeded_and_fraction_sized():
    from storyrl.training.storyteller.reward_model import split_pairs

    rows = [{"story_id": f"s{k // 2}", "chosen": "a", "rejected": "b", "_line": k + 1} for k in range(20)]
    train, held = split_pairs(rows, 0.3, seed=0)
    held_ids = {r["story_id"] for r in held}
    assert len(held_ids) == 3 and len(held) == 6 and not held_ids & {r["story_id"] for r in train}
    assert split_pairs(rows, 0.3, seed=0) == (train, held)
    assert {r["story_id"] for r in split_pairs(rows, 0.3, seed=1)[1]} != held_ids
    assert split_pairs(rows, 0.0, seed=0) == (rows, [])
    # no story_id: each pair is its own group; a single group is never all held out
    loose = [{"chosen": "a", "rejected": "b", "_line": k} for k in range(10)]
    assert len(split_pairs(loose, 0.5, seed=0)[1]) == 5
    assert split_pairs(rows[:2], 0.9, seed=0) == (rows[:2], [])


def test_max_length_and_include_prompt_change_the_trained_tokens(assets, tmp_path):
    from storyrl.training.storyteller.reward_model import build_trainer

    trainer, _, prompt = build_trainer(config_of(assets, tmp_path / "a"), progress=False)
    tokenizer = trainer.processing_class
    first = trainer.train_dataset[0]
    assert prompt == PROMPT
    assert first["chosen_ids"] == hand_ids(tokenizer, assets["rows"][0]["chosen"], PROMPT)
    trainer, _, prompt = build_trainer(config_of(assets, tmp_path / "b", include_prompt=False, max_length=4),
                                       progress=False)
    first = trainer.train_dataset[0]
    assert prompt is None
    assert first["rejected_ids"] == hand_ids(tokenizer, assets["rows"][0]["rejected"], None, 4)
    assert len(first["rejected_ids"]) == 4 and len(trainer.train_dataset) == 8  # cut, not dropped


def test_include_prompt_false_saves_no_prompt_and_the_reward_scores_the_story_alone(assets, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.reward_model import train

    result = train(config_of(assets, tmp_path / "out", include_prompt=False, max_length=32), progress=False)
    final = result.final_dir
    metadata = json.loads((Path(final) / "storyrl_reward_model.json").read_text())
    assert metadata["prompt"] is None and metadata["max_length"] == 32
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    story = good("the dog")
    got = create_reward("reward_model", model=final, device="cpu").score([story])[0]
    assert got == pytest.approx(logit(model, hand_ids(tokenizer, story, None, 32)), abs=1e-5)


def test_lora_merge_saves_full_weights_and_adapters_load_in_the_reward(assets, tmp_path):
    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.reward_model import train

    lora = {"enabled": True, "r": 4, "alpha": 8}
    adapters = train(config_of(assets, tmp_path / "a", lora=lora), progress=False)
    assert (Path(adapters.final_dir) / "adapter_config.json").is_file()
    merged = train(config_of(assets, tmp_path / "m", lora={**lora, "merge": True}), progress=False)
    assert not (Path(merged.final_dir) / "adapter_config.json").exists()
    a = create_reward("reward_model", model=adapters.final_dir, device="cpu").score([good("a cat"), bad("a cat")])
    m = create_reward("reward_model", model=merged.final_dir, device="cpu").score([good("a cat"), bad("a cat")])
    np.testing.assert_allclose(a, m, atol=1e-4)  # the same seed and data: the same run, saved two ways


def test_resume_equals_an_uninterrupted_run(assets, tmp_path):
    import torch
    from safetensors.torch import load_file

    from storyrl.training.storyteller.reward_model import train

    whole = train(config_of(assets, tmp_path / "whole", max_steps=4, batch_size=4, save_steps=2), progress=False)
    cut = tmp_path / "cut"
    train(config_of(assets, cut, max_steps=4, batch_size=4, save_steps=2), progress=False)
    import shutil

    for path in ("final", "checkpoint-4"):  # as if killed after checkpoint-2
        shutil.rmtree(cut / path)
    resumed = train(config_of(assets, cut, max_steps=4, batch_size=4, save_steps=2), resume=True, progress=False)
    assert resumed.steps == 4
    a = load_file(Path(whole.final_dir) / "model.safetensors")
    b = load_file(Path(resumed.final_dir) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the reward -------------------------------------------------------------------------------


def test_reward_scores_equal_a_forward_pass_and_batched_equals_one_by_one(trained):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from storyrl.rewards import create_reward

    final = trained.final_dir
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    stories = [good("the dog"), "we went home .", "a long day at the park with the dog .", bad("my mom")]
    reward = create_reward("reward_model", model=final, device="cpu", batch_size=3)
    batch = reward.score(stories)
    want = [logit(model, hand_ids(tokenizer, s, PROMPT)) for s in stories]
    np.testing.assert_allclose(batch, want, atol=1e-5)
    np.testing.assert_allclose(batch, [reward.score([s])[0] for s in stories], atol=1e-5)
    assert batch[0] > batch[3]  # learnt: good over bad
    # max_length replaces the trained limit: the logit of the first 5 tokens
    short = create_reward("reward_model", model=final, device="cpu", max_length=5).score(stories[:1])[0]
    assert short == pytest.approx(logit(model, hand_ids(tokenizer, stories[0], PROMPT, 5)), abs=1e-5)
    assert short != pytest.approx(batch[0], abs=1e-4)


def test_empty_and_non_text_stories_are_nan_and_trl_gets_none(trained):
    from storyrl.rewards import create_reward

    reward = create_reward("reward_model", model=trained.final_dir, device="cpu")
    scores = reward.score([good("a cat"), "", "   ", None])
    assert np.isfinite(scores[0]) and np.isnan(scores[1:]).all()
    assert reward(prompts=["p"] * 2, completions=[good("a cat"), ""])[1] is None
    assert reward.stats["reasons"]["empty story"] == 3


def test_reward_pickles_and_scores_the_same(trained):
    import pickle

    from storyrl.rewards import create_reward

    reward = create_reward("reward_model", model=trained.final_dir, device="cpu")
    want = reward.score([good("a cat")])
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(reward)).score([good("a cat")]), want)


def test_score_command_uses_the_trained_model(trained, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.rewards import create_reward

    stories = tmp_path / "stories.jsonl"
    stories.write_text(json.dumps({"story_id": "x", "story": good("the dog")}) + "\n", encoding="utf-8")
    out = tmp_path / "scores.csv"
    result = CliRunner().invoke(main, ["score", str(stories), "-m", "reward_model", "--reward-model-model",
                                       trained.final_dir, "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    want = create_reward("reward_model", model=trained.final_dir, device="cpu").score([good("the dog")])[0]
    (row,) = csv.DictReader(out.open())
    assert float(row["reward_model"]) == pytest.approx(want, abs=1e-6)


# -- configs and errors ------------------------------------------------------------------------


def test_bad_configs_are_one_line_errors(assets, tmp_path):
    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig, build_trainer

    with pytest.raises(ValueError, match="pairs: no such file"):
        config_of(assets, tmp_path / "o", pairs=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="eval_fraction"):
        config_of(assets, tmp_path / "o", eval_fraction=1.0)
    with pytest.raises(ValueError, match="unknown key 'lr'"):
        RewardModelRunConfig.from_mapping({**options(assets, tmp_path / "o"), "lr": 1})
    mixed = write_pairs(tmp_path / "mixed.jsonl", [pair(0, "a cat"), pair(1, "the dog", prompt="Another prompt.")])
    with pytest.raises(ValueError, match=r"mixed.jsonl: include_prompt needs one prompt shared by every pair, but "
                                         r"line 1 and line 2 differ \('Write a .*' vs 'Another prompt.'\); set "
                                         r"include_prompt: false$") as info:
        build_trainer(config_of(assets, tmp_path / "o", pairs=mixed), progress=False)
    assert "\n" not in str(info.value)
    broken = write_pairs(tmp_path / "broken.jsonl", [pair(0, "a cat"), {"chosen": "x", "rejected": ""}])
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2: 'rejected' must be a non-empty string"):
        build_trainer(config_of(assets, tmp_path / "o", pairs=broken), progress=False)
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="not a text model; TRL's RewardTrainer scores text only"):
        config_of(assets, tmp_path / "o", model=str(vlm))
    with pytest.raises(ValueError, match="no storyrl_reward_model.json"):
        create_reward("reward_model", model=str(tmp_path))


def test_cli_reads_the_yaml_and_prints_the_summary(assets, tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    config = tmp_path / "rm.yaml"
    config.write_text(yaml.safe_dump(options(assets, tmp_path / "out", max_steps=5, eval_fraction=0.25)),
                      encoding="utf-8")
    result = CliRunner().invoke(main, ["train", "reward_model", "--config", str(config), "--max-steps", "2", "-q"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 2 and summary["heldout_pairs"] == 2 and 0 <= summary["heldout_accuracy"] <= 1
    again = CliRunner().invoke(main, ["train", "reward_model", "--config", str(config), "-q"])
    assert again.exit_code != 0 and "already holds a run" in again.output


# -- meta-eval pairs reads storyrl pairs rows ---------------------------------------------------


def test_meta_eval_pairs_reads_chosen_rejected_rows(tmp_path):
    from storyrl.judgements import JudgementDataError
    from storyrl.judgements.pairs import load_pairs_jsonl

    path = write_pairs(tmp_path / "p.jsonl", [pair(0, "a cat", images=["1.jpg", "2.jpg"])])
    (got,) = load_pairs_jsonl(path)
    assert (got.better, got.worse, got.story_id, got.images) == (good("a cat"), bad("a cat"), "s0",
                                                                 ("1.jpg", "2.jpg"))
    both = write_pairs(tmp_path / "b.jsonl", [{**pair(0, "a cat"), "better": "x"}])
    with pytest.raises(JudgementDataError, match="line 1: give 'better'/'worse' or 'chosen'/'rejected', not both"):
        load_pairs_jsonl(both)
    half = write_pairs(tmp_path / "h.jsonl", [{"chosen": "x"}])
    with pytest.raises(JudgementDataError, match="missing field 'rejected'"):
        load_pairs_jsonl(half)


def test_meta_eval_pairs_command_scores_storyrl_pairs(tmp_path):
    from click.testing import CliRunner

    from storyrl.cli import main

    rows = [{"prompt": PROMPT, "chosen": "We ran to the sea. The waves were cold. Dad laughed.",
             "rejected": "There is a beach. There is a beach. There is a beach.", "story_id": "s0", "images": []}]
    path = write_pairs(tmp_path / "p.jsonl", rows)
    out = tmp_path / "table.csv"
    result = CliRunner().invoke(main, ["meta-eval", "pairs", "--pairs", path, "-m", "repetition", "-o", str(out),
                                       "-q"])
    assert result.exit_code == 0, result.output
    assert "repetition" in out.read_text()


# -- the break review's cases ------------------------------------------------------------------


def test_whitespace_stories_non_string_ids_and_empty_files_are_refused(tmp_path):
    from storyrl.training.storyteller.reward_model import read_pairs

    blank = write_pairs(tmp_path / "blank.jsonl", [pair(0, "a cat"), {**pair(1, "the dog"), "chosen": " \n\t "}])
    with pytest.raises(ValueError, match=r"blank.jsonl: line 2: 'chosen' must be a non-empty string"):
        read_pairs(blank)
    blank = write_pairs(tmp_path / "blank2.jsonl", [{**pair(0, "a cat"), "rejected": "   "}])
    with pytest.raises(ValueError, match=r"blank2.jsonl: line 1: 'rejected' must be a non-empty string"):
        read_pairs(blank)
    number = write_pairs(tmp_path / "number.jsonl", [pair(0, "a cat"), {**pair(1, "the dog"), "story_id": 7}])
    with pytest.raises(ValueError, match=r"number.jsonl: line 2: 'story_id' must be a string"):
        read_pairs(number)
    for name, text in (("empty.jsonl", ""), ("spaces.jsonl", "\n  \n\t\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=rf"{name}: no preference pairs$"):
            read_pairs(tmp_path / name)


def test_include_prompt_with_rows_without_a_prompt_is_refused(assets, tmp_path):
    from storyrl.training.storyteller.reward_model import build_trainer

    rows = [pair(0, SUBJECTS[0]), *({k: v for k, v in pair(k, s).items() if k != "prompt"}
                                    for k, s in enumerate(SUBJECTS[1:3], start=1))]
    path = write_pairs(tmp_path / "noprompt.jsonl", rows)
    # The file, the first line without one and the missing key, on one line.
    with pytest.raises(ValueError, match=r"^pairs \S*noprompt.jsonl: line 2: no 'prompt' \(include_prompt: true "
                                         r"scores the pairs' prompt before each story\); give the pairs their "
                                         r"prompt or set include_prompt: false$"):
        build_trainer(config_of(assets, tmp_path / "o", pairs=path), progress=False)
    trainer, _, prompt = build_trainer(config_of(assets, tmp_path / "o", pairs=path, include_prompt=False),
                                       progress=False)
    assert prompt is None and len(trainer.train_dataset) == 3


def _groups(n: int) -> list[dict]:
    # two pairs per group
    return [{"story_id": f"g{k // 2}", "chosen": "a", "rejected": "b", "_line": k + 1} for k in range(2 * n)]


@pytest.mark.parametrize(("fraction", "groups", "held"), [
    (0.9, 2, 1),    # round(1.8) = 2 would hold out every group: one stays in training
    (0.9, 3, 2),    # round(2.7) = 3 -> 2
    (0.3, 6, 2),    # round(1.8) = 2, not int(1.8) = 1
    (0.25, 6, 2),   # round(1.5) = 2 (half to even)
    (0.01, 10, 1),  # round(0.1) = 0 -> at least one
    (0.1, 10, 1),
    (0.5, 1, 0),    # a single group is never held out
])
def test_split_holds_out_round_fraction_times_groups_keeping_one_for_training(fraction, groups, held):
    from storyrl.training.storyteller.reward_model import split_pairs

    rows = _groups(groups)
    for seed in range(3):
        train, out = split_pairs(rows, fraction, seed)
        assert len({r["story_id"] for r in out}) == held and len(out) == 2 * held
        assert len(train) == len(rows) - len(out) and train  # every row in one side, training never empty


def test_epochs_sets_the_steps_and_save_steps_the_checkpoints(assets, tmp_path):
    from storyrl.training.storyteller.reward_model import train

    # 8 pairs, 4 a step: 2 steps an epoch
    result = train(config_of(assets, tmp_path / "e", max_steps=None, epochs=2.0, batch_size=4, save_steps=3),
                   progress=False)
    assert result.steps == 4
    assert sorted(p.name for p in Path(tmp_path / "e").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    result = train(config_of(assets, tmp_path / "h", max_steps=None, epochs=0.5, batch_size=4, save_steps=1),
                   progress=False)
    assert result.steps == 1
    result = train(config_of(assets, tmp_path / "s", max_steps=5, batch_size=4, save_steps=2), progress=False)
    assert sorted(p.name for p in Path(tmp_path / "s").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-5"]


def test_a_backbone_without_a_pad_token_id_trains_in_batches(assets, tmp_path):
    from transformers import AutoConfig

    from storyrl.training.storyteller.reward_model import load_backbone, pair_accuracy, read_pairs, train

    backbone = tmp_path / "nopad"
    save_tiny_llama(backbone, TEXTS, chat=False)
    config = AutoConfig.from_pretrained(backbone)
    config.pad_token_id = None
    config.save_pretrained(backbone)
    assert AutoConfig.from_pretrained(backbone).pad_token_id is None
    # load_backbone sets it (TRL's RewardTrainer does too, but the accuracy before training does not pass there)
    model, tokenizer = load_backbone(config_of(assets, tmp_path / "o", model=str(backbone)))
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert 0 <= pair_accuracy(model, tokenizer, read_pairs(assets["pairs"]), PROMPT, 64) <= 1  # 16 texts a batch
    result = train(config_of(assets, tmp_path / "out", model=str(backbone), batch_size=4, max_steps=2),
                   progress=False)
    assert result.steps == 2 and all(math.isfinite(e["loss"]) for e in result.history if "loss" in e)
    assert AutoConfig.from_pretrained(result.final_dir).pad_token_id is not None


def test_without_progress_nothing_is_printed(assets, tmp_path, capfd):
    from click.testing import CliRunner

    from storyrl.cli import main
    from storyrl.training.storyteller.reward_model import train

    train(config_of(assets, tmp_path / "out", max_steps=2, logging_steps=1), progress=False)
    assert capfd.readouterr().out == ""
    config = tmp_path / "rm.yaml"
    config.write_text(yaml.safe_dump(options(assets, tmp_path / "cli", max_steps=2, logging_steps=1)),
                      encoding="utf-8")
    result = CliRunner().invoke(main, ["train", "reward_model", "--config", str(config), "--quiet"])
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()
    assert json.loads(line)["steps"] == 2


def test_pair_accuracy_counts_ties_as_wrong(assets, tmp_path):
    import torch

    from storyrl.training.storyteller.reward_model import load_backbone, pair_accuracy, read_pairs

    model, tokenizer = load_backbone(config_of(assets, tmp_path / "o"))
    with torch.no_grad():
        model.score.weight.zero_()  # every text scores 0: no pair is ordered
    rows = read_pairs(assets["pairs"])
    assert pair_accuracy(model, tokenizer, rows, PROMPT, 64) == 0.0
    assert pair_accuracy(model, tokenizer, [], PROMPT, 64) is None


def test_heldout_file_holds_the_input_rows_and_history_the_logs_then_the_accuracy(trained, assets):
    out = Path(trained.output_dir)
    held = [json.loads(x) for x in (out / "heldout_pairs.jsonl").read_text().splitlines()]
    assert len(held) == 2 and all(row in assets["rows"] for row in held)  # as read: no "_line"
    lines = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if "loss" in e] == [5, 10, 15, 20, 25]
    assert lines[:-1] == trained.history[:-1]  # the trainer's log, then the held-out line
    assert lines[-1] == {"heldout_pairs": 2, "heldout_accuracy": 1.0, "step": 25}


def test_resume_starts_at_the_checkpoint(assets, tmp_path, monkeypatch):
    import shutil

    from transformers import TrainerCallback

    from storyrl.training.storyteller import reward_model

    options_ = {"max_steps": 4, "batch_size": 4, "save_steps": 2}
    reward_model.train(config_of(assets, tmp_path / "cut", **options_), progress=False)
    for path in ("final", "checkpoint-4"):
        shutil.rmtree(tmp_path / "cut" / path)
    seen = {"begin": [], "steps": []}

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["begin"].append(state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            seen["steps"].append(state.global_step)

    build = reward_model.build_trainer
    monkeypatch.setattr(reward_model, "build_trainer", lambda config, progress: build(config, progress, [Spy()]))
    result = reward_model.train(config_of(assets, tmp_path / "cut", **options_), resume=True, progress=False)
    assert seen == {"begin": [2], "steps": [3, 4]} and result.steps == 4


# -- the reward: text, EOS, metadata, padding ---------------------------------------------------


def test_scored_text_and_encode_add_no_second_separator_or_eos(assets):
    from transformers import AutoTokenizer

    from storyrl.rewards.reward_model import encode, scored_text

    assert scored_text("b", "a\n") == "a\nb"
    assert scored_text("b", "a") == "a b"
    assert scored_text("b", "") == "b"
    assert scored_text("b", None) == "b"
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    eos = tokenizer.eos_token_id
    once = encode(tokenizer, "we went home .", 64)
    assert once[-1] == eos and once[-2] != eos
    assert encode(tokenizer, "we went home ." + tokenizer.eos_token, 64) == once


@pytest.mark.parametrize("max_length", ["64", True, 0, 64.0, None])
def test_metadata_with_a_bad_max_length_is_refused_at_setup(trained, tmp_path, max_length):
    import shutil

    from storyrl.rewards import create_reward
    from storyrl.rewards.base import RewardError

    final = tmp_path / "final"
    shutil.copytree(trained.final_dir, final)
    metadata = json.loads((final / "storyrl_reward_model.json").read_text())
    (final / "storyrl_reward_model.json").write_text(json.dumps({**metadata, "max_length": max_length}))
    with pytest.raises(RewardError, match="storyrl_reward_model.json: expected max_length") as info:
        create_reward("reward_model", model=str(final), device="cpu").setup()
    assert "\n" not in str(info.value)


LONG = ("a long day at the park with the dog . the kids went home . the bird was good and happy . "
        "our team was bad and sad . my mom was good and happy . we went home .")


def test_batched_scores_equal_one_by_one_with_an_encoder_and_different_lengths(tmp_path):
    import torch
    from tiny_models import bert_config, bert_wordpiece_tokenizer
    from transformers import BertForSequenceClassification

    from storyrl.rewards import create_reward

    final = tmp_path / "bert"
    tokenizer = bert_wordpiece_tokenizer([*TEXTS, LONG], tmp_path / "vocab")
    torch.manual_seed(0)
    # wide initial weights: random stories score far apart, so a padding fault shows
    model = BertForSequenceClassification(bert_config(len(tokenizer), num_labels=1, initializer_range=0.5)).eval()
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "storyrl_reward_model.json").write_text(json.dumps({"max_length": 100, "prompt": None,
                                                                 "include_prompt": False}))
    stories = ["we went home .", LONG, "the dog was good and happy .", "home ."]
    assert len(tokenizer(LONG)["input_ids"]) > 4 * len(tokenizer("we went home .")["input_ids"])
    reward = create_reward("reward_model", model=str(final), device="cpu", batch_size=4)
    batch = reward.score(stories)
    want = [logit(model, tokenizer(s)["input_ids"]) for s in stories]  # no padding at all
    np.testing.assert_allclose(batch, want, atol=1e-5)
    np.testing.assert_allclose(batch, [reward.score([s])[0] for s in stories], atol=1e-5)
    assert np.diff(np.sort(batch)).min() > 1e-2  # the model tells the stories apart


def test_batched_scores_equal_one_by_one_with_the_causal_lm_and_different_lengths(trained):
    from storyrl.rewards import create_reward

    stories = ["home .", LONG, "we went home .", LONG + " " + LONG]
    reward = create_reward("reward_model", model=trained.final_dir, device="cpu", batch_size=4)
    np.testing.assert_allclose(reward.score(stories), [reward.score([s])[0] for s in stories], atol=1e-5)


def test_a_rejected_row_with_better_worse_is_the_both_formats_error(tmp_path):
    from storyrl.judgements import JudgementDataError
    from storyrl.judgements.pairs import load_pairs_jsonl

    path = write_pairs(tmp_path / "p.jsonl", [{"rejected": "x", "better": "a", "worse": "b"}])
    with pytest.raises(JudgementDataError, match="line 1: give 'better'/'worse' or 'chosen'/'rejected', not both"):
        load_pairs_jsonl(path)
    path = write_pairs(tmp_path / "q.jsonl", [{"rejected": "x", "worse": "b"}])
    with pytest.raises(JudgementDataError, match="line 1: give 'better'/'worse' or 'chosen'/'rejected', not both"):
        load_pairs_jsonl(path)
    path = write_pairs(tmp_path / "r.jsonl", [{"rejected": "x"}])
    with pytest.raises(JudgementDataError, match="line 1: missing field 'chosen'"):
        load_pairs_jsonl(path)


# -- issue 31: conversation prompts (storyrl pairs --policy), identical pairs ---------------------


def chat_pair(k: int, subject: str, prompt) -> dict:
    return {**pair(k, subject), "prompt": prompt}


#: The prompt of `storyrl pairs --policy` rows: a chat model's user turn, and a VLM's (image + text parts).
CHAT_PROMPT = [{"role": "user", "content": PROMPT}]
VLM_PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]


@pytest.fixture(scope="module")
def chat_model(assets):
    return save_tiny_llama(assets["root"] / "chat_llama", TEXTS)  # tests/tiny_models.CHAT_TEMPLATE


@pytest.mark.parametrize("conversation", [CHAT_PROMPT, VLM_PROMPT], ids=["chat", "vlm"])
def test_conversation_prompts_train_and_the_reward_scores_as_trained(assets, chat_model, tmp_path, conversation):
    """Pairs of a chat policy carry the prompt as messages: the model reads
    the conversation's text rendered by its chat template up to the
    assistant turn (the tiny template by hand: "user : TEXT\\nassistant :"),
    the trained loss is the Bradley-Terry loss of those tokens, and the
    reward scores a story after the very same text."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from storyrl.rewards import create_reward
    from storyrl.training.storyteller.reward_model import load_backbone, train

    path = write_pairs(tmp_path / "chat.jsonl", [chat_pair(k, s, conversation) for k, s in enumerate(SUBJECTS)])
    config = config_of(assets, tmp_path / "out", model=chat_model, pairs=path)
    rendered = f"user : {PROMPT}\nassistant :"  # the image part dropped: the reward model reads text only
    model, tokenizer = load_backbone(config)
    model.eval()
    chosen = torch.tensor([logit(model, hand_ids(tokenizer, good(s), rendered)) for s in SUBJECTS])
    rejected = torch.tensor([logit(model, hand_ids(tokenizer, bad(s), rendered)) for s in SUBJECTS])
    want = float(-torch.log(torch.sigmoid(chosen - rejected)).mean())
    result = train(config, progress=False)
    assert [e["loss"] for e in result.history if "loss" in e] == [pytest.approx(want, rel=1e-4)]
    metadata = json.loads((Path(result.final_dir) / "storyrl_reward_model.json").read_text())
    assert metadata["prompt"] == rendered and metadata["include_prompt"] is True
    trained = AutoModelForSequenceClassification.from_pretrained(result.final_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.final_dir)
    stories = [good("the dog"), bad("a cat")]
    got = create_reward("reward_model", model=result.final_dir, device="cpu").score(stories)
    np.testing.assert_allclose(got, [logit(trained, hand_ids(tokenizer, s, rendered)) for s in stories], atol=1e-5)


def test_a_conversation_without_a_chat_template_is_its_texts_one_per_line(assets, tmp_path):
    from storyrl.training.storyteller.reward_model import build_trainer

    conversation = [{"role": "system", "content": "we went home ."}, *VLM_PROMPT]
    path = write_pairs(tmp_path / "plain.jsonl", [chat_pair(k, s, conversation) for k, s in enumerate(SUBJECTS)])
    trainer, _, prompt = build_trainer(config_of(assets, tmp_path / "o", pairs=path), progress=False)
    assert prompt == f"we went home .\n{PROMPT}"
    assert trainer.train_dataset[0]["chosen_ids"] == hand_ids(trainer.processing_class, good(SUBJECTS[0]), prompt)


def test_prompt_text_leaves_the_bos_to_the_tokenizer():
    from storyrl.rewards.reward_model import prompt_text

    class Tokenizer:  # a template that writes the BOS a tokenizer also adds
        chat_template, bos_token, bos_token_id = "x", "<s>", 1

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and not tokenize
            return "<s>" + "".join(f"[{m['role']}] {m['content']}" for m in messages) + " [assistant]"

        def __call__(self, text):
            return {"input_ids": [1, *range(2, 2 + len(text.split()))]}

    assert prompt_text(VLM_PROMPT, Tokenizer()) == f"[user] {PROMPT} [assistant]"
    assert prompt_text("as it is", Tokenizer()) == "as it is"

    class NoBos(Tokenizer):  # the template writes a BOS the tokenizer does not add: it stays
        def __call__(self, text):
            return {"input_ids": list(range(2, 2 + len(text.split())))}

    assert prompt_text(VLM_PROMPT, NoBos()) == f"<s>[user] {PROMPT} [assistant]"


def test_one_conversation_written_with_its_keys_in_another_order_is_one_prompt():
    from storyrl.training.storyteller.reward_model import shared_prompt

    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    reordered = [{"content": [{"text": PROMPT, "type": "text"}, {"type": "image"}][::-1], "role": "user"}]
    rows = [{"prompt": conversation, "_line": 1}, {"prompt": reordered, "_line": 2}]
    assert shared_prompt(rows, "p.jsonl") == conversation


def test_a_conversation_the_template_cannot_render_is_one_line(assets, chat_model, tmp_path):
    from storyrl.training.storyteller.reward_model import build_trainer

    path = write_pairs(tmp_path / "bad.jsonl", [chat_pair(0, "a cat", [{"role": "user", "content": 7}])])
    with pytest.raises(ValueError, match=r"^pairs \S*bad.jsonl: .*content must be a string or a list") as info:
        build_trainer(config_of(assets, tmp_path / "o", model=chat_model, pairs=path), progress=False)
    assert "\n" not in str(info.value)


def test_pairs_whose_chosen_is_the_rejected_are_refused_all_or_warned_some(assets, tmp_path, caplog):
    import logging

    from storyrl.training.storyteller.reward_model import build_trainer

    same = [{**pair(k, s), "rejected": good(s) + " "} for k, s in enumerate(SUBJECTS)]  # whitespace aside
    path = write_pairs(tmp_path / "same.jsonl", same)
    with pytest.raises(ValueError, match=r"^\S*same.jsonl: chosen equals rejected in all 8 pairs: nothing to learn"):
        build_trainer(config_of(assets, tmp_path / "o", pairs=path), progress=False)
    some = write_pairs(tmp_path / "some.jsonl", [*same[:2], *(pair(k, s) for k, s in enumerate(SUBJECTS[2:], 2))])
    with caplog.at_level(logging.WARNING):
        trainer, _, _ = build_trainer(config_of(assets, tmp_path / "o", pairs=some), progress=False)
    assert len(trainer.train_dataset) == 8
    (warning,) = [r.getMessage() for r in caplog.records if "chosen equals rejected" in r.getMessage()]
    assert warning.endswith("some.jsonl: chosen equals rejected in 2 of 8 pairs (line 1, 2); they teach nothing")


def test_a_lora_adapter_directory_is_a_backbone_merged_into_its_base(assets, tmp_path):
    """``model: runs/sft/final`` of an SFT run with lora.merge false: the
    backbone is the base with the adapters merged (plain weights the
    reward model's own LoRA trains on), not transformers' frozen peft
    attachment."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from storyrl.training.storyteller.reward_model import load_backbone, train

    base = AutoModelForCausalLM.from_pretrained(assets["model"])
    peft_model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    adapters = tmp_path / "sft_final"
    peft_model.save_pretrained(adapters)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(adapters)
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        merged_q = layer.base_layer.weight + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * 2.0
    model, _ = load_backbone(config_of(assets, tmp_path / "o", model=str(adapters)))
    assert not any("lora" in name for name, _ in model.named_parameters())
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.weight, merged_q)
    result = train(config_of(assets, tmp_path / "out", model=str(adapters), lora={"enabled": True, "r": 4,
                                                                                   "alpha": 8, "merge": True}),
                   progress=False)
    assert result.steps == 1 and (Path(result.final_dir) / "model.safetensors").is_file()
