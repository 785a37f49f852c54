"""The paper-scale recipe's semantics (examples/llava_next_vist/): what each
step reads and writes, asserted on the commands run.sh prints
(``STORYRL_RECIPE_PRINT=1``, no step runs) and on the YAML files; and
run.sh's step function on a failing command. Cheap: no model is loaded."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from test_example_llava_next_vist import RECIPE, ROOT, RUN_SH, recipe_steps

R = "runs/llava_next_vist"


def _yaml(name: str) -> dict:
    return yaml.safe_load((RECIPE / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def settings() -> dict:
    """settings.sh's NAME=value lines."""
    return dict(re.findall(r"^([A-Z_]+)=(\S+)", (RECIPE / "settings.sh").read_text(), re.M))


@pytest.fixture(scope="module")
def steps() -> dict:
    """step name -> {option: value} (and "argv") of each command run.sh would run."""
    out = {}
    for name, argv in recipe_steps(ROOT):
        options = {"argv": argv}
        for k, arg in enumerate(argv[:-1]):
            if arg.startswith("-") and not argv[k + 1].startswith("-"):
                options.setdefault(arg, argv[k + 1])
        out[name] = options
    return out


def test_each_systems_kl_is_to_the_model_it_started_from(steps, settings):
    sft_final = _yaml("sft.yaml")["output_dir"] + "/final"
    assert steps["kl_sft"]["--reference"] == settings["BASE_MODEL"] == _yaml("sft.yaml")["model"]
    for name in ("grpo_dhm", "dpo"):
        assert steps[f"kl_{name}"]["--reference"] == sft_final == _yaml(f"{name}.yaml")["model"], name
        assert steps[f"generate_{name}"]["--model"] == _yaml(f"{name}.yaml")["output_dir"] + "/final"
    assert steps["generate_sft"]["--model"] == sft_final == f"{R}/sft/final"


def test_pairs_and_rovist_c_read_the_train_split_only(steps):
    train = steps["records_train"]
    assert train["-o"].endswith("records/train.jsonl") and train["--image-root"].endswith("images/train")
    assert steps["pairs"]["--data"] == train["-o"] and steps["pairs"]["--image-root"] == train["--image-root"]
    assert steps["pairs"]["--policy"] == f"{R}/sft/final"
    assert _yaml("coherence.yaml")["stories"] == [train["-o"]]
    for name in ("sft.yaml", "grpo_dhm.yaml"):
        assert (_yaml(name)["data"], _yaml(name)["image_root"]) == (train["-o"], train["--image-root"]), name


def test_generate_and_pairs_take_their_settings(steps, settings):
    for name in ("zero_shot", "sft", "grpo_dhm", "dpo"):
        assert steps[f"generate_{name}"]["--max-new-tokens"] == settings["GEN_MAX_NEW_TOKENS"], name
        assert steps[f"generate_{name}"]["--data"] == steps["records_test"]["-o"]
    assert settings["GEN_MAX_NEW_TOKENS"] != settings["PAIRS_MAX_NEW_TOKENS"]  # else the check above is blind
    pairs = steps["pairs"]
    assert pairs["--limit"] == settings["PAIRS_LIMIT"] and pairs["-k"] == settings["PAIRS_K"]
    assert pairs["--max-new-tokens"] == settings["PAIRS_MAX_NEW_TOKENS"]


def test_records_steps_overwrite_so_a_rerun_after_a_cleared_done_works(steps):
    for split in ("train", "val", "test"):
        assert "--overwrite" in steps[f"records_{split}"]["argv"], split


def test_every_storyteller_is_asked_the_same_prompt(steps):
    from storyrl.cli.pairs import SAMPLING_DEFAULTS

    prompts = {name: (_yaml(name)["prompt"], _yaml(name)["fill_count"])
               for name in ("sft.yaml", "grpo_dhm.yaml", "dpo.yaml")}
    for name in ("zero_shot", "sft", "grpo_dhm", "dpo"):
        argv = steps[f"generate_{name}"]["argv"]
        fill = "--no-fill-count" not in argv  # generate fills the count by default
        prompts[f"generate_{name}"] = (steps[f"generate_{name}"]["--prompt"], fill)
    # storyrl pairs fills the count (its prompts say "five sentences"); its prompt is --prompt-name or P3
    prompts["pairs"] = (steps["pairs"].get("--prompt-name", SAMPLING_DEFAULTS["prompt_name"]), True)
    assert set(prompts.values()) == {("P3", True)}, prompts


def test_the_models_later_steps_load_are_merged_full_weights():
    # sft.yaml's final/ is the next runs' start and reference and grpo_dhm.yaml's
    # final/ is "full weights, like the SFT model" (their comments)
    for name in ("sft.yaml", "grpo_dhm.yaml"):
        assert _yaml(name)["lora"]["merge"] is True, name


def test_dhm_yaml_is_minus_the_distance_along_all_three_dimensions():
    # The direction is also scored on tiny models (test_example_llava_next_vist::
    # test_the_training_reward_prefers_the_human_story); the dimensions are
    # pinned: d_HM is the paper's distance along all three, a dropped one
    # would still rank the human story first.
    dhm = _yaml("dhm.yaml")
    assert dhm["reward"] == "dhm" and dhm["sign"] == -1
    assert dhm["dimensions"] == ["grounding", "coherence", "repetition"]
    assert set(dhm["rewards"]) == {"grounding", "coherence", "repetition"}


def test_the_coherence_model_is_trained_in_the_mode_it_is_used_in():
    trained = _yaml("coherence.yaml")["mode"]
    assert _yaml("dhm.yaml")["rewards"]["coherence"]["mode"] == trained
    evaluation = yaml.safe_load((RECIPE / "rewards/coherence.yaml").read_text())
    if "mode" in evaluation:
        assert evaluation["mode"] == trained


def test_the_stated_settings_are_the_yaml_settings():
    # beta of GRPO and DPO as examples/llava_next_vist/README.md and its docs page state them
    for page in (RECIPE / "README.md", ROOT / "docs/examples/llava_next_vist.md"):
        text = page.read_text(encoding="utf-8")
        assert f"β {_yaml('grpo_dhm.yaml')['grpo']['beta']} (per-token KL)" in text, page
        assert f"DPO (sigmoid loss, β {_yaml('dpo.yaml')['beta']}," in text, page
    # RoViST-C: "The paper's settings (configs/training/coherence.yaml)", its comment says
    paper = yaml.safe_load((ROOT / "configs/training/coherence.yaml").read_text())
    ours = _yaml("coherence.yaml")
    for key in ("lr", "weight_decay", "lr_decay", "batch_size", "patience", "mode", "base_model"):
        assert ours[key] == paper[key], key


def test_a_failing_step_stops_run_sh_and_is_not_marked_done(tmp_path):
    """run.sh's own header and step function (everything before step 1), then
    a step that succeeds, one that fails, and a line that must not run."""
    text = RUN_SH.read_text(encoding="utf-8")
    header = text[: text.index("\n# 1. Data")]
    (tmp_path / "examples/llava_next_vist").mkdir(parents=True)
    shutil.copy(RECIPE / "settings.sh", tmp_path / "examples/llava_next_vist/settings.sh")
    script = tmp_path / "steps.sh"
    script.write_text(header + "\nstep ok -- true\nstep bad -- false\necho AFTER\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "STORYRL_RECIPE_PRINT"}
    env.update(STORYRL_RECIPE_ROOT=str(tmp_path), VIRTUAL_ENV="test")
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "AFTER" not in done.stdout, done.stdout + done.stderr
    assert (tmp_path / R / "done/ok").is_file() and not (tmp_path / R / "done/bad").exists()
