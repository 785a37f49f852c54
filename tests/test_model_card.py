"""storyrl's model card in a storyteller's final/ (issue 31 item 13): TRL
wrote "a fine-tuned version of [None]" into OUTPUT_DIR and PEFT its template
beside every adapter; now final/README.md says what the run was -- base
model, data, rewards, command, storyrl's version, date -- and the
libraries' cards are gone from OUTPUT_DIR and its checkpoints."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from click.testing import CliRunner
from tiny_models import TAPM_TEXTS, save_tiny_llama, write_images

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)
from storyrl.training.model_card import (CARD_MARK, command_line, is_storyrl_card, model_card,
                                         remove_library_cards, write_model_card)

P1 = "Write a story using exactly {n} sentences for this image sequence. Do not use more than {n} sentences."


def front_matter_and_rows(text: str) -> tuple[dict, dict[str, str]]:
    _, front, body = text.split("---\n", 2)
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 2 and cells[0]:
            rows[cells[0]] = cells[1]
    return yaml.safe_load(front), rows


def rl_config(model: str, **extra) -> SimpleNamespace:
    lora = SimpleNamespace(enabled=True, merge=False, r=4, alpha=8)
    return SimpleNamespace(**{"model": model, "revision": None, "data": "data/train.jsonl", "data_format": "auto",
                              "image_root": "images/", "algorithm": "grpo", "rewards": ["dhm", {"reward": "bleu"}],
                              "reward_weights": [1.0, 0.25], "prompt": "P3", "lora": lora, **extra})


def test_card_rows_for_an_rl_run_on_a_hub_model(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "rl_config.yaml").write_text("{}")
    text = model_card(tmp_path, rl_config("org/base-7b", revision="v2"), "rl", steps=12,
                      command="storyrl train rl --config c.yaml")
    front, rows = front_matter_and_rows(text)
    assert front == {"library_name": "peft", "base_model": "org/base-7b",
                     "tags": ["storyrl", "visual-storytelling", "rl"]}
    assert CARD_MARK in text and "[None]" not in text
    assert rows["trainer"] == "`storyrl train rl`, algorithm `grpo`"
    assert rows["base model"] == "`org/base-7b` at revision `v2`"
    assert rows["weights"] == "LoRA adapters (rank 4, alpha 8) on the base model"
    assert rows["data"] == "`data/train.jsonl`, images in `images/`"
    assert rows["rewards"] == '`dhm` × 1, `{"reward": "bleu"}` × 0.25'
    assert rows["optimisation steps"] == "12"
    assert rows["command"] == "`storyrl train rl --config c.yaml`"
    assert rows["storyrl"] == f"`{version('storyrl')}`"
    written = datetime.strptime(rows["date"], "%Y-%m-%d %H:%M UTC").replace(tzinfo=timezone.utc)
    assert abs((datetime.now(timezone.utc) - written).total_seconds()) < 600
    assert "`rl_config.yaml` beside this file" in text


def test_card_of_a_local_base_merged_weights_names_no_hub_base(tmp_path):
    local = tmp_path / "base"
    local.mkdir()
    config = rl_config(str(local), rewards=[], reward_weights=None, algorithm=None)
    config.lora.merge = True
    front, rows = front_matter_and_rows(model_card(tmp_path, config, "sft", command="x"))
    assert "base_model" not in front and front["library_name"] == "transformers"  # the hub's key names hub models
    assert rows["base model"] == f"`{local}`" and "merged" in rows["weights"]
    assert "rewards" not in rows and rows["trainer"] == "`storyrl train sft`"


def test_a_pipe_or_backtick_cannot_break_the_table(tmp_path):
    config = rl_config("org/m", data="a|b`c.jsonl", rewards=[], reward_weights=None)
    _, rows = front_matter_and_rows(model_card(tmp_path, config, "sft", command="x"))
    assert rows["data"].startswith("`a\\|b'c.jsonl`")


@pytest.mark.parametrize("argv, expected", [
    (["/venv/bin/storyrl", "train", "sft", "--config", "a b.yaml"], "storyrl train sft --config 'a b.yaml'"),
    (["/repo/storyrl/__main__.py", "train", "rl"], "storyrl train rl"),
    (["/repo/storyrl/cli/__main__.py", "train", "dpo"], "storyrl train dpo"),
])
def test_command_line_is_the_storyrl_command(argv, expected):
    assert command_line(argv) == expected


def test_command_line_of_a_python_script():
    assert command_line(["train.py", "--x"]) == f"{Path(sys.executable).name} train.py --x"


def test_library_cards_are_removed_and_storyrls_stays(tmp_path):
    (tmp_path / "README.md").write_text("# Model Card for run\nfine-tuned version of [None]")
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "README.md").write_text("---\nlibrary_name: peft\n---\n[More Information Needed]")
    (tmp_path / "final").mkdir()
    mine = write_model_card(tmp_path / "final", rl_config("org/m"), "rl")
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "README.md").write_text(mine.read_text())
    removed = remove_library_cards(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in removed) == ["README.md", "checkpoint-1/README.md"]
    assert is_storyrl_card(tmp_path / "checkpoint-2" / "README.md") and is_storyrl_card(mine)


# -- through the command line: TRL's SFT (save_final) and storyrl's PPO (the CLI's card) ----------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("card")
    images = [str(p) for p in write_images(root / "images", 3)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"story_id": f"s{k}", "story": " ".join(TAPM_TEXTS[k:k + 2]),
                                        "images": images}) + "\n" for k in range(4)), encoding="utf-8")
    return {"data": str(data), "model": save_tiny_llama(root / "llama", [*TAPM_TEXTS, P1.format(n="three")])}


def train(tmp_path, monkeypatch, name: str, config: dict) -> dict:
    from storyrl.cli import main

    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))
    args = ["train", name, "--config", str(path), "-q"]
    monkeypatch.setattr(sys, "argv", ["/venv/bin/storyrl", *args])  # what the console script sees
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])


def readmes(output_dir: str) -> list[str]:
    return sorted(p.relative_to(output_dir).as_posix() for p in Path(output_dir).rglob("README.md"))


@pytest.mark.usefixtures("trl_offline")
def test_sft_final_has_storyrls_card_and_no_library_cards_remain(assets, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    summary = train(tmp_path, monkeypatch, "sft", {
        "model": assets["model"], "data": assets["data"], "output_dir": str(out), "prompt": "P1", "max_steps": 2,
        "save_steps": 1, "batch_size": 2, "logging_steps": 1, "seed": 0,
        "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert readmes(str(out)) == ["final/README.md"]  # TRL's (OUTPUT_DIR) and PEFT's (checkpoints) are gone
    text = (out / "final" / "README.md").read_text()
    front, rows = front_matter_and_rows(text)
    assert "[None]" not in text and "More Information Needed" not in text
    assert front["library_name"] == "peft" and "base_model" not in front  # a local base
    assert rows["base model"] == f"`{assets['model']}`"
    assert rows["data"] == f"`{assets['data']}`"
    assert rows["optimisation steps"] == str(summary["steps"]) == "2"
    assert rows["command"] == f"`storyrl train sft --config {tmp_path / 'sft.yaml'} -q`"
    assert rows["storyrl"] == f"`{version('storyrl')}`" and rows["date"].endswith("UTC")


@pytest.mark.usefixtures("trl_offline")
def test_ppo_final_gets_the_card_from_the_command(assets, tmp_path, monkeypatch):
    out = tmp_path / "ppo"
    train(tmp_path, monkeypatch, "rl", {
        "algorithm": "ppo", "model": assets["model"], "data": assets["data"], "output_dir": str(out),
        "prompt": "P1", "rewards": ["rouge_l", "repetition"], "reward_weights": [1.0, 0.5], "max_steps": 1,
        "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    assert readmes(str(out)) == ["final/README.md"]
    _, rows = front_matter_and_rows((out / "final" / "README.md").read_text())
    assert rows["trainer"] == "`storyrl train rl`, algorithm `ppo`"
    assert rows["rewards"] == "`rouge_l` × 1, `repetition` × 0.5"
    assert rows["weights"] == "LoRA adapters (rank 4, alpha 8) on the base model"
