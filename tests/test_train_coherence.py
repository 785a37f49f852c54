"""RoViST-C training: SOP example construction, story-level split, and a tiny
end-to-end run (random tiny ALBERT and word-level tokenizer, tests/tiny_models.py)."""

from __future__ import annotations

import json
import math
import pickle
import random

import storyrl  # noqa: F401  (before torch/transformers: CPU torchvision fallback)

import numpy as np
import pytest
import torch
from tiny_models import albert_tokenizer, coherence_model

from storyrl.training.judges.coherence import (
    CoherenceTrainConfig,
    build_sop_examples,
    split_examples,
    train_coherence,
)

STORY_A = "Tom woke up. He ate eggs. He went to work."
STORY_B = "The sun rose. Birds sang."


# Tiny models train faster on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def test_build_sop_examples_prefix():
    examples = build_sop_examples([STORY_A, "Only one sentence.", STORY_B], mode="prefix")
    assert examples == [
        ("Tom woke up.", "He ate eggs.", 1),
        ("He ate eggs.", "Tom woke up.", 0),
        ("Tom woke up. He ate eggs.", "He went to work.", 1),
        ("He went to work.", "Tom woke up. He ate eggs.", 0),
        ("The sun rose.", "Birds sang.", 1),
        ("Birds sang.", "The sun rose.", 0),
    ]
    assert [e.story for e in examples] == [0, 0, 0, 0, 2, 2]
    assert all(type(e[2]) is int for e in examples)
    # Survives pickling (DataLoader workers) with its story index.
    copy = pickle.loads(pickle.dumps(examples[4]))
    assert copy == examples[4] and copy.story == 2


def test_build_sop_examples_adjacent_and_skips():
    examples = build_sop_examples([STORY_A, STORY_B], mode="adjacent")
    assert examples == [
        ("Tom woke up.", "He ate eggs.", 1),
        ("He ate eggs.", "Tom woke up.", 0),
        ("He ate eggs.", "He went to work.", 1),
        ("He went to work.", "He ate eggs.", 0),
        ("The sun rose.", "Birds sang.", 1),
        ("Birds sang.", "The sun rose.", 0),
    ]
    # A sentence repeating its first segment gives no pair (the scorer's 0).
    assert build_sop_examples(["It rained. It rained. Then it stopped."], mode="adjacent") == [
        ("It rained.", "Then it stopped.", 1),
        ("Then it stopped.", "It rained.", 0),
    ]
    with pytest.raises(ValueError, match="mode"):
        build_sop_examples([STORY_A], mode="random")


def test_split_examples_by_story():
    stories = [f"Story {k} starts. It goes on. It ends." for k in range(40)]
    examples = build_sop_examples(stories)
    train, val = split_examples(examples, val_fraction=0.15, seed=3)
    assert len(train) + len(val) == len(examples)
    train_stories, val_stories = {e.story for e in train}, {e.story for e in val}
    assert not train_stories & val_stories
    assert len(val_stories) == 6 and len(train_stories) == 34  # round(0.15 * 40)
    # Order within each side is the original order.
    assert train == [e for e in examples if e.story in train_stories]
    # Deterministic per seed, different across seeds.
    assert split_examples(examples, 0.15, seed=3) == (train, val)
    assert {e.story for e in split_examples(examples, 0.15, seed=4)[1]} != val_stories
    # Plain tuples: a pair and its swapped negative stay together.
    plain = [tuple(e) for e in examples]
    ptrain, pval = split_examples(plain, 0.5, seed=0)
    for a, b, _ in pval:
        assert (b, a, 0) in pval or (b, a, 1) in pval


# ---------------------------------------------------------------------------
# Tiny end-to-end training
# ---------------------------------------------------------------------------

NAMES = ["Tom", "Ann", "Sam", "Mia", "Joe", "Eva"]
PLACES = ["market", "park", "beach", "school", "library", "zoo"]
THINGS = ["apple", "book", "ball", "hat", "kite", "cake"]


def synthetic_stories(n: int, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    stories = {}
    for k in range(n):
        name, place, thing = rng.choice(NAMES), rng.choice(PLACES), rng.choice(THINGS)
        sentences = [
            f"{name} woke up early in the morning.",
            f"Then {name} walked to the {place}.",
            f"At the {place} {name} found a {thing}.",
            f"Finally {name} went home with the {thing}.",
        ]
        stories[f"s{k}"] = " ".join(sentences[: rng.choice([3, 4])])
    return stories


def make_tokenizer():
    """The words of 200 synthetic stories, in alphabetical order."""
    return albert_tokenizer(synthetic_stories(200).values(), sort_vocab=True, vocab_size=128)


def tiny_model():
    return coherence_model(seed=0, size="small", dropout=0.1)


def test_train_coherence_end_to_end(tmp_path):
    from storyrl.rewards import create_reward
    from storyrl.models.coherence import CoherenceModel, encode_pairs
    from storyrl.training.judges.coherence import sop_step

    stories = synthetic_stories(40)
    (tmp_path / "a.json").write_text(json.dumps(dict(list(stories.items())[:25])), encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for sid, story in list(stories.items())[25:]:
            f.write(json.dumps({"story_id": sid, "story": story}) + "\n")

    config = CoherenceTrainConfig(
        output_dir=str(tmp_path / "run"),
        stories=[str(tmp_path / "a.json"), str(tmp_path / "b.jsonl")],
        epochs=4,
        batch_size=16,
        lr=1e-3,
        max_length=64,
        patience=4,
        base_model="unreachable/never-loaded",  # model and tokenizer are injected
    )
    tokenizer = make_tokenizer()
    model = tiny_model()
    result = train_coherence(config, progress=False, model=model, tokenizer=tokenizer)

    history = result.history
    assert result.epochs_run == 4 and len(history) == 4
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert all("train_acc" in r and "val_acc" in r for r in history)
    saved = CoherenceTrainConfig.from_yaml(tmp_path / "run" / "config.yaml")
    assert saved == config

    best_dir = tmp_path / "run" / "best"
    reloaded, reloaded_tok = CoherenceModel.from_pretrained(best_dir)
    assert reloaded_tok is not None
    assert reloaded_tok("tom went home")["input_ids"] == tokenizer("tom went home")["input_ids"]

    # The reloaded best model reproduces the best epoch's validation loss.
    examples = build_sop_examples(stories.values(), mode="prefix")
    _, val = split_examples(examples, config.val_fraction, config.seed)
    batch = encode_pairs(tokenizer, [(a, b) for a, b, _ in val], config.max_length)
    batch["labels"] = torch.tensor([label for _, _, label in val])
    with torch.no_grad():
        val_loss, metrics = sop_step(reloaded.eval(), batch)
    assert float(val_loss) == pytest.approx(result.best_val_loss, rel=1e-4, abs=1e-6)

    pairs = [
        ("Tom woke up early in the morning.", "Then Tom walked to the zoo."),
        ("Then Ann walked to the park.", "Ann woke up early in the morning."),
    ]
    with torch.no_grad():
        enc = encode_pairs(tokenizer, pairs, 64)
        logits = reloaded(**enc)
        if result.best_epoch == result.epochs_run:  # best is the in-memory model
            torch.testing.assert_close(model.eval()(**enc), logits, rtol=0, atol=0)

    # The trained directory works as the coherence reward.
    reward = create_reward("coherence", model=str(best_dir), device="cpu", precision="fp32")
    story = " ".join(p for p in pairs[0])
    (score,) = reward.score([story])
    expected = float(torch.softmax(logits[0], -1)[1])
    assert score == pytest.approx(expected, abs=1e-5)
    assert math.isnan(reward.score(["Just one sentence."])[0])


def test_train_coherence_resume_and_errors(tmp_path):
    stories = synthetic_stories(12, seed=1)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(stories), encoding="utf-8")
    config = CoherenceTrainConfig(
        output_dir=str(tmp_path / "run"), stories=[str(path)], epochs=1, batch_size=16, lr=1e-3, max_length=32
    )
    first = train_coherence(config, progress=False, model=tiny_model(), tokenizer=make_tokenizer())
    assert first.epochs_run == 1
    config2 = CoherenceTrainConfig(**{**config.to_dict(), "epochs": 2})
    second = train_coherence(config2, resume=True, progress=False, model=tiny_model(), tokenizer=make_tokenizer())
    assert second.epochs_run == 2 and second.history[0] == first.history[0]

    # --resume of a run killed before its first checkpoint starts it (as train rl does)
    fresh = train_coherence(
        CoherenceTrainConfig(**{**config.to_dict(), "output_dir": str(tmp_path / "none")}),
        resume=True,
        progress=False,
        model=tiny_model(),
        tokenizer=make_tokenizer(),
    )
    losses = lambda r: [(h["train_loss"], h["val_loss"]) for h in r.history]  # noqa: E731
    assert fresh.epochs_run == 1 and losses(fresh) == losses(first)

    short = tmp_path / "short.json"
    short.write_text(json.dumps({"a": "One sentence.", "b": "Two. Sentences."}), encoding="utf-8")
    with pytest.raises(ValueError, match="at least 2 stories"):
        train_coherence(
            CoherenceTrainConfig(output_dir=str(tmp_path / "x"), stories=[str(short)]),
            progress=False,
            model=tiny_model(),
            tokenizer=make_tokenizer(),
        )


def test_config_yaml_file_and_defaults(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    config = CoherenceTrainConfig.from_yaml(repo / "configs" / "training" / "coherence.yaml", output_dir=str(tmp_path))
    # The paper's settings (RoViST App. B).
    assert (config.lr, config.weight_decay, config.lr_decay) == (1e-5, 1e-5, 0.95)
    assert (config.batch_size, config.patience, config.val_fraction) == (32, 5, 0.15)
    assert config.base_model == "albert-large-v1" and config.mode == "prefix" and config.dropout == 0.4
    assert config.stories and config.output_dir == str(tmp_path)

    with pytest.raises(ValueError, match="stories"):
        CoherenceTrainConfig.from_yaml(_write(tmp_path, "output_dir: o\n"))
    with pytest.raises(ValueError, match="'mode'"):
        CoherenceTrainConfig.from_yaml(_write(tmp_path, "output_dir: o\nstories: [a]\nmode: 3\n"))
    with pytest.raises(ValueError, match="mode must be one of"):
        CoherenceTrainConfig.from_yaml(_write(tmp_path, "output_dir: o\nstories: [a]\nmode: random\n"))
    assert np.isclose(CoherenceTrainConfig(output_dir="o", stories=["a"]).lr, 1e-5)


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_train_command_line(tmp_path):
    """`storyrl train coherence --config ...` as users run it, continuing from
    a saved tiny model (init_from), then resumed."""
    from click.testing import CliRunner

    from storyrl.cli import main

    start = tmp_path / "start"
    tiny_model().save_pretrained(start, make_tokenizer())
    stories = tmp_path / "stories.json"
    stories.write_text(json.dumps(synthetic_stories(12)))
    config = tmp_path / "train.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'run'}\nstories: [{stories}]\ninit_from: {start}\n"
        "epochs: 2\nbatch_size: 8\nlr: 0.001\n"
    )
    runner = CliRunner()
    result = runner.invoke(main, ["train", "coherence", "--config", str(config), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["epochs_run"] == 2 and (tmp_path / "run" / "best").is_dir()
    again = runner.invoke(main, ["train", "coherence", "--config", str(config), "--resume", "-q"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    bad = runner.invoke(main, ["train", "coherence", "--config", str(stories)])
    assert bad.exit_code != 0 and str(stories) in bad.output


def test_train_command_line_output_dir(tmp_path):
    """`--output-dir` replaces the config's output_dir for everything the run
    writes, and `--resume` looks there: a `--max-steps` stop inside the epoch,
    then a resume that finishes it."""
    from click.testing import CliRunner

    from storyrl.cli import main

    start = tmp_path / "start"
    tiny_model().save_pretrained(start, make_tokenizer())
    stories = tmp_path / "stories.json"
    stories.write_text(json.dumps(synthetic_stories(12)))
    in_config, chosen = tmp_path / "from_config", tmp_path / "chosen"
    config = tmp_path / "train.yaml"
    config.write_text(
        f"output_dir: {in_config}\nstories: [{stories}]\ninit_from: {start}\nepochs: 1\nbatch_size: 8\nlr: 0.001\n"
    )
    runner = CliRunner()
    args = ["train", "coherence", "--config", str(config), "--output-dir", str(chosen), "-q"]
    stopped = runner.invoke(main, [*args, "--max-steps", "2"], catch_exceptions=False)
    assert stopped.exit_code == 0, stopped.output
    assert json.loads(stopped.output.strip().splitlines()[-1])["output_dir"] == str(chosen)
    assert not in_config.exists()
    assert (chosen / "last" / "trainer_state.json").is_file()
    assert CoherenceTrainConfig.from_yaml(chosen / "config.yaml").output_dir == str(chosen)
    (record,) = [json.loads(line) for line in (chosen / "history.jsonl").read_text().splitlines()]
    assert record["step"] == 2 and record["partial"] is True

    resumed = runner.invoke(main, [*args, "--resume"], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.output.strip().splitlines()[-1])
    assert summary["output_dir"] == str(chosen) and summary["epochs_run"] == 1
    assert not in_config.exists()
    (record,) = [json.loads(line) for line in (chosen / "history.jsonl").read_text().splitlines()]
    assert record["step"] > 2 and "partial" not in record
    assert (chosen / "best" / "storyrl_coherence.json").is_file()
