"""The paper-scale recipe, examples/llava_next_vist/, end to end on tiny models.

run.sh is asked for its steps (``STORYRL_RECIPE_PRINT=1``: bash expands
settings.sh and every variable and prints each step's argv without running
it), and each step then runs in order through storyrl's command line,
in-process, in a scratch directory laid out as run.sh expects:

* ``data/vist/sis/*.story-in-sequence.json`` and ``data/vist/images/<split>/``:
  tiny VIST slices (``test_documented_path.write_vist_sis``), one train photo
  missing, so ``storyrl records`` leaves its story out; the authors' zero-shot
  stories file the recipe scores when it is there;
* ``examples/llava_next_vist/``: the recipe's own files, every one of them,
  with only the keys of :data:`ALLOWED` changed (checked per file): the
  models (LLaVA-NeXT-7B -> a tiny LLaVA-NeXT, CLIP ViT-B/32 -> a tiny CLIP,
  albert-large-v1 -> a tiny ALBERT, spaCy's English pipelines -> a tiny
  pipeline tagging a fixed noun list) and the sizes (one or two optimizer
  steps, 24 new tokens, 3 pair sequences).

The tiny LLaVA-NeXT writes story-shaped text: its decoder is turned into a
bigram sampler over a few story words and full stops (:func:`bigram_storyteller`),
because d_HM scores no story of one sentence and a random 7B-shaped decoder
writes no full stops (the dhm reward would then score nothing, and GRPO and
`storyrl pairs` rightly refuse to train on nothing). The run is shared by the
assertions (module fixture, about half a minute on 2 cores).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_documented_path import SENTENCES, TEXTS, running_in, write_vist_sis

import storyrl  # noqa: F401  (torchvision fallback before trl/transformers)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "llava_next_vist"
RUN_SH = RECIPE / "run.sh"

#: What the test may change in the recipe's files: the models, and sizes.
MODELS = {"BASE_MODEL", "model", "base_model", "clip_model", "clip_pretrained", "spacy_pipeline",
          "rewards.grounding.clip_model", "rewards.grounding.clip_pretrained", "rewards.grounding.spacy_pipeline"}
SIZES = {"GEN_MAX_NEW_TOKENS", "PAIRS_LIMIT", "PAIRS_MAX_NEW_TOKENS", "BOOTSTRAP_RESAMPLES", "epochs", "max_steps",
         "batch_size", "max_length", "sample_steps", "sample_prompts", "sample_max_new_tokens",
         "grpo.per_device_train_batch_size", "grpo.gradient_accumulation_steps", "grpo.num_generations",
         "grpo.max_completion_length"}
ALLOWED = MODELS | SIZES

#: The chain of the bigram storyteller's greedy stories, a full stop after every third word.
CHAIN = ["dog", "ran", "park", "cat", "sat", "mat", "family", "party", "kids", "snow", "tree", "cake"]
NOUNS = {"dog", "park", "cat", "mat", "family", "party", "kids", "snow", "tree", "cake", "car", "home"}
VOCABULARY = [*TEXTS, "[INST] [/INST]"]  # the authors' chat format's words, so their prompt is cut off

STEPS = ["records_train", "records_val", "records_test", "coherence", "score_human",
         "generate_zero_shot", "score_zero_shot", "dhm_zero_shot", "score_paper_zero_shot", "dhm_paper_zero_shot",
         "sft", "generate_sft", "score_sft", "dhm_sft", "kl_sft",
         "grpo_dhm", "generate_grpo_dhm", "score_grpo_dhm", "dhm_grpo_dhm", "kl_grpo_dhm",
         "pairs", "dpo", "generate_dpo", "score_dpo", "dhm_dpo", "kl_dpo", "compare"]


def _tag_nouns(doc):
    """The tiny spaCy pipeline's one component: NOUNS are nouns, each its own
    noun chunk (every token a root), everything else is not."""
    for token in doc:
        token.pos_ = "NOUN" if token.lower_ in NOUNS else "X"
        token.dep_ = "ROOT"
    return doc


def _register_component() -> str:
    from spacy.language import Language

    name = "storyrl_recipe_test_nouns"
    if not Language.has_factory(name):
        Language.component(name, func=_tag_nouns)
    return name


def bigram_storyteller(directory: Path) -> str:
    """``tiny_models.save_tiny_chat_vlm`` whose decoder predicts the next
    token from the current one alone (attention and MLP outputs zeroed, so
    the last hidden state is the token's embedding): after the prompt a
    story word, after a word its successor in :data:`CHAIN` (or a full stop
    after every third), another word or a full stop, after a full stop a
    word or the end. Greedy decoding walks the chain ("dog ran park . cat
    ..."); sampling writes stories of about three sentences."""
    import torch
    from tiny_models import save_tiny_chat_vlm
    from transformers import AutoModelForImageTextToText, AutoProcessor

    save_tiny_chat_vlm(directory, VOCABULARY)
    model = AutoModelForImageTextToText.from_pretrained(directory)
    tokenizer = AutoProcessor.from_pretrained(directory).tokenizer
    lm = model.model.language_model
    assert not model.config.get_text_config().tie_word_embeddings
    words = [tokenizer.convert_tokens_to_ids(w) for w in CHAIN]
    dot, eos, unk = (tokenizer.convert_tokens_to_ids(t) for t in (".", tokenizer.eos_token, tokenizer.unk_token))
    assert unk not in [*words, dot]
    scale = lm.config.hidden_size ** 0.5  # RMSNorm of a one-hot row
    after_dot, start = len(words), len(words) + 1
    with torch.no_grad():
        for layer in lm.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        lm.norm.weight.fill_(1.0)
        embed, head = lm.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[:, start] = 1.0  # the prompt's tokens: a story starts next
        head.fill_(-10.0 / scale)
        head[words] = 0.0  # any word may follow any token of a story
        for k, w in enumerate(words):
            embed[w] = 0.0
            embed[w, k] = 1.0
            head[dot, k] = 1.0 / scale
            head[dot if k % 3 == 2 else words[(k + 1) % len(words)], k] = 3.0 / scale
        embed[dot] = 0.0
        embed[dot, after_dot] = 1.0
        head[words[0], start] = 3.0 / scale
        head[dot, start] = -10.0 / scale
        head[eos, after_dot] = 2.0 / scale
        head[dot, after_dot] = -10.0 / scale
        head[words[3], after_dot] = 3.0 / scale
    model.save_pretrained(directory)
    return str(directory)


def tiny_albert(directory: Path) -> str:
    """A random ALBERT and its word-level tokenizer: the coherence trainer's ``base_model``."""
    from tiny_models import albert_config, albert_tokenizer
    from transformers import AlbertModel

    AlbertModel(albert_config("tiny")).save_pretrained(directory)
    albert_tokenizer([*SENTENCES, " ".join(CHAIN)], vocab_size=64).save_pretrained(directory)
    return str(directory)


def tiny_spacy(directory: Path) -> str:
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe(_register_component())
    nlp.to_disk(directory)
    return str(directory)


def storyrl_assets(directory: Path) -> Path:
    """``storyrl assets``' two files in a cache folder (``STORYRL_CACHE``): the nouns rated concrete."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "concreteness_ratings.csv").write_text(
        "Word;Conc.M\n" + "".join(f"{w};{4.0 + 0.05 * k:.2f}\n" for k, w in enumerate(sorted(NOUNS))),
        encoding="utf-8")
    (directory / "all_pronouns.txt").write_text("it\nwe\nthey\nhe\nshe\n", encoding="utf-8")
    return directory


# -- the recipe's files, as the test may change them ----------------------------------------------------------


def recipe_files() -> list[str]:
    """Every file run.sh reads besides itself (relative to the recipe)."""
    return sorted(str(p.relative_to(RECIPE)) for p in [*RECIPE.rglob("*.yaml"), RECIPE / "settings.sh"])


def _set(data: dict, key: str, value) -> None:
    *sections, leaf = key.split(".")
    for section in sections:
        data = data[section]
    data[leaf] = value


def _has(data: dict, key: str) -> bool:
    *sections, leaf = key.split(".")
    for section in sections:
        data = data.get(section) if isinstance(data, dict) else None
    return isinstance(data, dict) and leaf in data


def derived(root: Path, name: str, changes: dict) -> dict:
    """The recipe's file ``name`` with ``changes`` written to ``root``'s copy of
    the recipe: each change must be in :data:`ALLOWED`, and a model key must
    be one the file has (a size may be added); settings.sh is NAME=value
    lines. Returns the changes."""
    text = (RECIPE / name).read_text(encoding="utf-8")
    for key in changes:
        assert key in ALLOWED, f"{name}: {key} is not a key the recipe test may change"
    if name.endswith(".sh"):
        for key, value in changes.items():
            text, n = re.subn(rf"^{key}=.*$", f"{key}={shlex.quote(str(value))}", text, flags=re.M)
            assert n == 1, f"{name}: no {key}= line"
    else:
        data = yaml.safe_load(text)
        for key, value in changes.items():
            assert key in SIZES or _has(data, key), f"{name}: has no {key} to point at a tiny model"
            _set(data, key, value)
        text = yaml.safe_dump(data, sort_keys=False)
    out = root / "examples" / "llava_next_vist" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return changes


def recipe_steps(root: Path) -> list[tuple[str, list[str]]]:
    """(step name, argv) of each step run.sh would run in ``root``, bash's own expansion."""
    env = {**os.environ, "STORYRL_RECIPE_PRINT": "1", "STORYRL_RECIPE_ROOT": str(root)}
    done = subprocess.run(["bash", str(RUN_SH)], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    steps = []
    for chunk in done.stdout.split(b"STEP\0")[1:]:
        name, *argv = chunk.decode().split("\0")[:-1]
        steps.append((name, argv))
    return steps


def run_step(argv: list[str]) -> tuple[str, dict | None]:
    """``storyrl ARGV[1:]`` in-process: its output and its JSON summary line, if any."""
    from storyrl.cli import main

    assert argv[0] == "storyrl", argv
    result = CliRunner().invoke(main, argv[1:], catch_exceptions=False)
    assert result.exit_code == 0, f"{shlex.join(argv)}\n{result.output}"
    lines = result.stdout.strip().splitlines()
    try:
        return result.output, json.loads(lines[-1]) if lines else None
    except ValueError:
        return result.output, None


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_clip):
    """The whole recipe, once: the scratch root, the steps, each step's output and summary."""
    models = tmp_path_factory.mktemp("recipe_models")
    base = bigram_storyteller(models / "llava_next")
    albert = tiny_albert(models / "albert")
    nlp = tiny_spacy(models / "spacy")
    cache = storyrl_assets(models / "storyrl_cache")
    root = tmp_path_factory.mktemp("recipe")
    write_vist_sis(root / "data/vist/sis/train.story-in-sequence.json", root / "data/vist/images/train", 6)
    (root / "data/vist/images/train/1010.jpg").unlink()  # story 1 has a photo missing
    write_vist_sis(root / "data/vist/sis/val.story-in-sequence.json", root / "data/vist/images/val", 2, first=6)
    write_vist_sis(root / "data/vist/sis/test.story-in-sequence.json", root / "data/vist/images/test", 4, first=8)
    paper = root / "data/dhm/vist/llava_vc_p3.json"
    paper.parent.mkdir(parents=True)
    paper.write_text(json.dumps({str(s): "the dog ran to the park . the cat sat on a red mat . we went home ."
                                 for s in range(8, 12)}))
    spacy_keys = {"spacy_pipeline": nlp}
    clip = {"clip_model": tiny_clip, "clip_pretrained": None}
    changes = {
        "settings.sh": {"BASE_MODEL": base, "GEN_MAX_NEW_TOKENS": 24, "PAIRS_LIMIT": 3, "PAIRS_MAX_NEW_TOKENS": 24,
                        "BOOTSTRAP_RESAMPLES": 200},
        "coherence.yaml": {"base_model": albert, "epochs": 1, "batch_size": 8, "max_length": 64},
        "rewards/groovist.yaml": {**clip, **spacy_keys},
        "rewards/coherence.yaml": {},
        "rewards/repetition.yaml": {},
        "dhm.yaml": {f"rewards.grounding.{k}": v for k, v in {**clip, **spacy_keys}.items()},
        "sft.yaml": {"model": base},
        "grpo_dhm.yaml": {"max_steps": 1, "grpo.per_device_train_batch_size": 2, "grpo.gradient_accumulation_steps": 1,
                          "grpo.num_generations": 2, "grpo.max_completion_length": 24},
        "dpo.yaml": {"sample_steps": 1, "sample_prompts": 2, "sample_max_new_tokens": 24},
    }
    assert sorted(changes) == recipe_files(), "every file of the recipe is run by this test"
    for name, change in changes.items():
        derived(root, name, change)
    steps = recipe_steps(root)
    outputs, summaries = {}, {}
    before = os.environ.get("STORYRL_CACHE")
    os.environ["STORYRL_CACHE"] = str(cache)
    try:
        with running_in(root):
            for name, argv in steps:
                outputs[name], summaries[name] = run_step(argv)
    finally:
        if before is None:
            os.environ.pop("STORYRL_CACHE", None)
        else:
            os.environ["STORYRL_CACHE"] = before
    yield {"root": root, "steps": steps, "outputs": outputs, "summaries": summaries, "changes": changes,
           "base": base}


@pytest.mark.slow
def test_run_sh_runs_every_step_in_order_through_storyrl_commands(recipe):
    steps = recipe["steps"]
    assert [name for name, _ in steps] == STEPS
    assert all(argv[0] == "storyrl" for _, argv in steps)
    used = {arg for _, argv in steps for arg in argv}
    for name in recipe_files():  # every config file is given to a command (dhm.yaml also by those of RL and DPO)
        if name.endswith(".yaml"):
            assert f"examples/llava_next_vist/{name}" in used, name
    # Every step continues an interrupted run (--resume) or writes its output whole (records, dhm, compare).
    for name, argv in steps:
        assert "--resume" in argv or argv[1] in ("records", "dhm", "compare"), name


@pytest.mark.slow
def test_records_keep_the_sequences_whose_images_are_all_there(recipe):
    summaries, root = recipe["summaries"], recipe["root"]
    assert summaries["records_train"]["kept"] == 5 and summaries["records_train"]["reasons"] == {"image not found": 1}
    train = [json.loads(x) for x in (root / "data/vist/records/train.jsonl").read_text().splitlines()]
    assert [r["story_id"] for r in train] == ["0", "2", "3", "4", "5"]
    assert train[0]["story"] == " ".join(SENTENCES[:5]) and train[0]["image_ids"] == [f"100{k}" for k in range(5)]
    ids = json.loads((root / "data/vist/records/test_image_ids.json").read_text())
    assert ids == {str(s): [f"{1000 + 10 * s + k}" for k in range(5)] for s in range(8, 12)}


@pytest.mark.slow
def test_every_trainer_finished_and_its_model_is_the_next_steps_input(recipe):
    summaries, root = recipe["summaries"], recipe["root"]
    run = root / "runs/llava_next_vist"
    assert (run / "coherence/best").is_dir()
    for name in ("sft", "grpo_dhm", "dpo"):
        assert summaries[name]["steps"] >= 1 and (run / name / "final").is_dir(), name
    assert summaries["pairs"]["pairs"] > 0
    meta = json.loads((run / "eval/grpo_dhm/stories.meta.json").read_text())
    assert meta["options"]["model"] == "runs/llava_next_vist/grpo_dhm/final"
    assert meta["options"]["prompt"] == "P3" and meta["options"]["setting"] == "visual"


@pytest.mark.slow
def test_the_tiny_storyteller_writes_sentences(recipe):
    stories = json.loads((recipe["root"] / "runs/llava_next_vist/eval/zero_shot/stories.json").read_text())
    assert sorted(stories) == ["10", "11", "8", "9"]
    assert all(s.startswith("dog ran park. cat sat mat.") for s in stories.values())  # the greedy chain


@pytest.mark.slow
def test_compare_reports_every_system_against_human_and_zero_shot(recipe):
    root, summaries = recipe["root"], recipe["summaries"]
    results = json.loads((root / "runs/llava_next_vist/eval/results.json").read_text())
    systems = {s["name"]: s for s in results["systems"]}
    assert list(systems) == ["zero_shot", "paper_zero_shot", "sft", "grpo_dhm", "dpo"]
    assert results["baseline"] == "zero_shot" and results["metrics"] == ["groovist", "coherence", "repetition"]
    for name, system in systems.items():
        # the table's d_HM is what `storyrl dhm` printed for the same score files
        printed = summaries[f"dhm_{name}"]
        assert system["n"] == printed["n"] and math.isclose(system["d_hm"], printed["d_hm"], rel_tol=1e-12), name
        assert set(system["distances"]) == {"grounding", "coherence", "repetition"}
        assert (name == "zero_shot") == (not system["deltas"])
        assert ("kl" in system["means"]) == (name in ("sft", "grpo_dhm", "dpo")), name
    for name in ("sft", "grpo_dhm", "dpo"):
        assert systems[name]["means"]["kl"] >= 0 and set(systems[name]["deltas"]) == {
            "d_hm", "grounding", "coherence", "repetition"}
    table = (root / "runs/llava_next_vist/eval/results.md").read_text()
    assert "| human | 4 |" in table and "Δ d_HM vs zero_shot" in table


@pytest.mark.slow
def test_a_finished_step_is_skipped_when_run_sh_runs_again(recipe, tmp_path):
    """run.sh itself (not its printed commands): steps marked finished are
    skipped, and a step whose mark is gone runs again (compare, rewriting
    its table from the same score files)."""
    root = recipe["root"]
    done = root / "runs/llava_next_vist/done"
    done.mkdir(exist_ok=True)
    for name in STEPS:
        (done / name).touch()
    (done / "compare").unlink()
    table = (root / "runs/llava_next_vist/eval/results.md").read_text()
    env = {**os.environ, "STORYRL_RECIPE_ROOT": str(root), "STORYRL_CACHE": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": sys.prefix}
    ran = subprocess.run(["bash", str(RUN_SH)], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    skipped = re.findall(r"^\[(\w+)\] finished before: skipped$", ran.stdout, flags=re.M)
    assert skipped == STEPS[:-1]
    assert (done / "compare").is_file()
    assert (root / "runs/llava_next_vist/eval/results.md").read_text() == table
    assert table in ran.stdout


def test_the_recipe_files_name_full_size_models():
    """What the test changed is the tiny stand-ins; the files as shipped name
    the paper's models."""
    shipped = {name: (RECIPE / name).read_text(encoding="utf-8") for name in recipe_files()}
    assert "BASE_MODEL=llava-hf/llava-v1.6-mistral-7b-hf" in shipped["settings.sh"]
    assert yaml.safe_load(shipped["sft.yaml"])["model"] == "llava-hf/llava-v1.6-mistral-7b-hf"
    assert yaml.safe_load(shipped["coherence.yaml"])["base_model"] == "albert-large-v1"
    assert yaml.safe_load(shipped["rewards/groovist.yaml"])["spacy_pipeline"] == "en_core_web_trf"
    assert yaml.safe_load(shipped["dhm.yaml"])["rewards"]["grounding"]["clip_pretrained"] == "openai"


def test_a_change_outside_the_allow_list_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="learning_rate is not a key"):
        derived(tmp_path, "sft.yaml", {"learning_rate": 1.0})
    with pytest.raises(AssertionError, match="has no clip_model"):
        derived(tmp_path, "sft.yaml", {"clip_model": "x"})


PAGES = [RECIPE / "README.md", ROOT / "docs/examples/llava_next_vist.md", ROOT / "docs/examples/rl_vist.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_recipe_pages_name_files_modules_and_commands_that_exist(page):
    from test_docs_guides import missing_files, unknown_commands, unresolved_names

    text = page.read_text(encoding="utf-8")
    assert missing_files(text) == [] and unresolved_names(text) == [] and unknown_commands(text) == []


def test_the_readme_shows_run_sh_commands():
    """Each command the README shows for a step is run.sh's (its subcommand
    and config files), so the page cannot describe another recipe."""
    text = (RECIPE / "README.md").read_text(encoding="utf-8")
    run = RUN_SH.read_text(encoding="utf-8")
    for config in sorted(set(re.findall(r"examples/llava_next_vist/[\w/]+\.yaml", text))):
        assert config.replace("examples/llava_next_vist/", "$E/") in run, config
    for command in ("records", "train coherence", "score", "generate", "dhm", "train sft", "kl", "train rl",
                    "pairs", "train dpo", "compare"):
        assert f"storyrl {command}" in text and f"storyrl {command}" in run, command


@pytest.mark.slow
def test_the_training_reward_prefers_the_human_story(recipe):
    """dhm.yaml as trained against (its coherence model is the recipe's own):
    a story equal to its sequence's human story is at distance 0, the best
    score; an unrelated story scores lower (a flipped sign would rank it higher)."""
    from storyrl.rewards import load_reward_config

    root = recipe["root"]
    record = json.loads((root / "data/vist/records/test.jsonl").read_text().splitlines()[0])
    images = [str(root / "data/vist/images/test" / f"{i}.jpg") for i in record["image_ids"]]
    unrelated = "the car went home . kids ate the cake in the snow . a tree fell on the family ."
    before = os.environ.get("STORYRL_CACHE")
    os.environ["STORYRL_CACHE"] = str(Path(recipe["base"]).parent / "storyrl_cache")
    try:
        with running_in(root):
            reward = load_reward_config("examples/llava_next_vist/dhm.yaml")
            human, other = reward.score([record["story"], unrelated], reference=[record["story"]] * 2,
                                        images=[images, images])
    finally:
        if before is None:
            os.environ.pop("STORYRL_CACHE", None)
        else:
            os.environ["STORYRL_CACHE"] = before
    assert human == pytest.approx(0.0, abs=1e-9) and other < human - 1e-6, (human, other)
