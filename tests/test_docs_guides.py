"""The guide pages (docs/generation, training, scale, eval, extending,
benchmarks.md, architecture.md) stay true of the code: every repository file
and every ``storyrl.*`` module or name they mention exists, every ``storyrl
<command>`` they show is a command of the click group, and the "Adding a
reward" page's example runs as written. Cheap: no model, no import of the
modules named (their files are read)."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import storyrl.rewards
from storyrl.cli import main
from storyrl.registry import Registry

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GUIDES = sorted([p for d in ("generation", "training", "scale", "eval", "extending") for p in (DOCS / d).glob("*.md")]
                + [DOCS / "benchmarks.md", DOCS / "architecture.md"])

#: Files the pages name that are not in the repository on purpose: what a user
#: would write (worked examples) or what a command writes.
EXAMPLE_FILES = {
    "storyrl/rewards/length.py", "configs/rewards/length.yaml",  # extending/adding_a_reward.md
    "configs/sft/vist.yaml",  # extending/adding_a_trainer.md (config_file="configs/sft/<name>.yaml")
    "benchmarks/gpu_report.md",  # benchmarks.md: gpu_suite.py's default --out
}
#: Module names of the worked examples (extending/adding_a_reward.md's module).
EXAMPLE_MODULES = {"storyrl.rewards.length"}
REPO_FILE = re.compile(
    r"(?<![\w/.-])((?:configs|benchmarks|examples|tests|storyrl)/[\w./-]*\w\.(?:yaml|py|md|sh|json|jsonl))")
CODE_SPANS = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
DOTTED = re.compile(r"(?<![\w.])storyrl(?:\.\w+)+")
COMMAND = re.compile(r"\bstoryrl[ ]+([a-z][a-z_-]*)(?:[ ]+([a-z][a-z_-]*))?")


def test_the_guide_pages_are_there():
    names = {p.relative_to(DOCS).as_posix() for p in GUIDES}
    assert {"generation/prompting.md", "training/rl.md", "scale/serve.md", "eval/score_tables.md",
            "extending/adding_a_trainer.md", "benchmarks.md", "architecture.md"} <= names


def repo_files_named(text: str) -> set[str]:
    return {m for m in REPO_FILE.findall(text) if "<" not in m and "*" not in m}


def missing_files(text: str) -> list[str]:
    return sorted(f for f in repo_files_named(text) - EXAMPLE_FILES if not (REPO / f).exists())


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_repository_file_a_page_names_exists(page):
    assert missing_files(page.read_text(encoding="utf-8")) == []


def unresolved_names(text: str, root: Path = REPO) -> list[str]:
    """Dotted ``storyrl.a.b.C`` names in code spans whose module is not a file
    of the package, or whose last part (a class, function or attribute) the
    module's source does not mention. Old paths (``storyrl.training.rl``
    after the move to ``storyrl.training.storyteller.rl``) fail here."""
    bad = []
    for span in CODE_SPANS.findall(text):
        for name in set(DOTTED.findall(span)) - EXAMPLE_MODULES:
            parts = name.split(".")
            found = None
            for n in range(len(parts), 0, -1):
                base = root.joinpath(*parts[:n])
                for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                    if candidate.is_file():
                        found = (n, candidate)
                        break
                if found:
                    break
            if found is None:
                bad.append(name)
                continue
            n, source = found
            rest = parts[n:]
            mentioned = not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text(encoding="utf-8"))
            if len(rest) > 1 or not mentioned:
                bad.append(name)
    return sorted(set(bad))


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_storyrl_module_and_name_a_page_shows_exists(page):
    assert unresolved_names(page.read_text(encoding="utf-8")) == []


def unknown_commands(text: str) -> list[str]:
    """``storyrl <command> [<subcommand>]`` in code spans that the click
    group does not have (a subcommand is checked for groups: train, meta-eval)."""
    ctx = click.Context(main)
    bad = []
    for span in CODE_SPANS.findall(text):
        for command, sub in COMMAND.findall(span):
            found = main.get_command(ctx, command)
            if found is None:
                bad.append(command)
            elif sub and isinstance(found, click.Group) and found.get_command(click.Context(found), sub) is None:
                bad.append(f"{command} {sub}")
    return sorted(set(bad))


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_storyrl_command_a_page_shows_exists(page):
    assert unknown_commands(page.read_text(encoding="utf-8")) == []


def test_the_checkers_find_planted_faults():
    """Each checker on text with one fault of its kind (an old module path, a
    missing config, a command that does not exist)."""
    assert missing_files("`configs/rl/grpo_llava_next.yaml` and `configs/rl/nope.yaml`") == ["configs/rl/nope.yaml"]
    assert unresolved_names("`storyrl.training.rl.sampling`, `storyrl.training.storyteller.rl.sampling`, "
                            "`storyrl.training.storyteller.rl.config.ALGORITHMS`, `storyrl.rewards.NoSuchReward`"
                            ) == ["storyrl.rewards.NoSuchReward", "storyrl.training.rl.sampling"]
    assert unknown_commands("```bash\nstoryrl train sft --config x\nstoryrl train nope\nstoryrl scor x\n"
                            "storyrl meta-eval pairs\n```") == ["scor", "train nope"]


# -- extending/adding_a_reward.md, run as written -----------------------------------------------

REWARD_PAGE = DOCS / "extending" / "adding_a_reward.md"


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL)


@pytest.fixture
def length_reward(monkeypatch):
    """The page's module as storyrl.rewards.length and a registry holding
    what its REWARDS.add line registers, in place of storyrl's."""
    module_code, registry_line = python_blocks(REWARD_PAGE)
    assert module_code.startswith("# storyrl/rewards/length.py\n")
    module = types.ModuleType("storyrl.rewards.length")
    monkeypatch.setitem(sys.modules, "storyrl.rewards.length", module)  # before: dataclasses look the module up
    exec(compile(module_code, str(REWARD_PAGE), "exec"), module.__dict__)  # noqa: S102  (the page's own code)
    registry = Registry("reward")
    exec(compile(registry_line, str(REWARD_PAGE), "exec"), {"REWARDS": registry})  # noqa: S102
    monkeypatch.setattr(storyrl.rewards, "REWARDS", registry)
    return module


def test_the_reward_of_adding_a_reward_scores_through_the_command_and_trl(length_reward, tmp_path):
    stories = {"a": "one two three four five", "b": "two words", "c": "   "}
    words = {k: len(v.split()) for k, v in stories.items()}  # the hand count: 5, 2, 0 (unscorable)
    reward = storyrl.rewards.create_reward("length", max_words=3)
    assert reward.name == "length" and reward.max_words == 3
    assert reward(prompts=["p"] * 3, completions=list(stories.values())) == [3.0, 2.0, None]

    runner = CliRunner()
    listing = runner.invoke(main, ["rewards", "length"])
    assert listing.exit_code == 0 and "max_words" in listing.output and "Longer stories score this." in listing.output
    path = tmp_path / "stories.json"
    path.write_text(json.dumps(stories), encoding="utf-8")
    out = tmp_path / "length.csv"
    result = runner.invoke(main, ["score", str(path), "-m", "length", "--max-words", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    rows = dict(line.split(",") for line in out.read_text(encoding="utf-8").splitlines()[1:])
    assert rows == {k: (str(float(min(n, 3))) if n else "") for k, n in words.items()}
    result = runner.invoke(main, ["score", str(path), "-m", "length", "--max-words", "0",
                                  "-o", str(tmp_path / "x.csv")])
    assert result.exit_code == 2 and "--max-words" in result.output  # the option's bound, from the dataclass
