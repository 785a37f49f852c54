"""Every shipped configs/training/*.yaml holds only real options of its
trainer, with values of the declared types inside the declared bounds (the
data paths in them are placeholders, so files are not required to exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "training").glob("*.yaml"))


def trainer_of(path: Path) -> str:
    """The trainer a file's usage line names (``storyrl train NAME --config ...``), else its stem."""
    found = re.search(r"storyrl train (\w+) --config \S*" + re.escape(path.name), path.read_text(encoding="utf-8"))
    return found.group(1) if found else path.stem


def option_problems(cls: type, data: dict) -> list[str]:
    """Unknown keys, missing required ones, wrong types and out-of-bounds
    values, as the config class checks them, without its file checks."""
    from storyrl.config import _bound_problem, check_type, option_info

    infos = {info.name: info for info in option_info(cls)}
    problems = [f"unknown key {key!r}" for key in data if key not in infos]
    problems += [f"missing {name!r}" for name, info in infos.items() if info.required and name not in data]
    for key, value in data.items():
        if key not in infos:
            continue
        try:
            value = check_type(value, infos[key].type)  # nested options (lora: ...) are built and checked whole
        except (TypeError, ValueError) as exc:
            problems.append(f"{key}: {exc}")
            continue
        if problem := _bound_problem(infos[key], value):
            problems.append(problem)
    return problems


def test_every_trainer_has_a_shipped_config():
    from storyrl.training import TRAINERS

    shipped = {trainer_of(path) for path in CONFIGS}
    assert {"reward_model", "dpo", "sft", "tapm", "coherence", "vrank"} <= shipped
    assert shipped <= set(TRAINERS.names())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_holds_only_valid_options(path):
    from storyrl.config import load_yaml
    from storyrl.training import TRAINERS

    data = load_yaml(path)
    assert isinstance(data, dict) and data
    cls = TRAINERS.get(trainer_of(path)).config_class
    assert option_problems(cls, data) == []


def test_the_check_finds_typos_wrong_types_and_bounds():
    from storyrl.config import load_yaml
    from storyrl.training.storyteller.reward_model import RewardModelRunConfig

    good = load_yaml(next(p for p in CONFIGS if p.name == "reward_model.yaml"))
    assert option_problems(RewardModelRunConfig, good) == []
    typo = {**{k: v for k, v in good.items() if k != "eval_fraction"}, "eval_fractoin": 0.1}
    assert option_problems(RewardModelRunConfig, typo) == ["unknown key 'eval_fractoin'"]
    assert option_problems(RewardModelRunConfig, {**good, "eval_fraction": 1.5}) == [
        "eval_fraction must be <= 0.9, got 1.5"]
    assert option_problems(RewardModelRunConfig, {**good, "max_steps": "1000"}) == [
        "max_steps: expected an integer, got str '1000'"]
    (problem,) = option_problems(RewardModelRunConfig, {**good, "lora": {**good["lora"], "rank": 8}})
    assert problem.startswith("lora:") and "unknown" in problem and "'rank'" in problem
    assert option_problems(RewardModelRunConfig, {k: v for k, v in good.items() if k != "model"}) == [
        "missing 'model'"]


# -- the storyrl command lines quoted in the comments of configs/**/*.yaml ---------------------------

ROOT = Path(__file__).resolve().parents[1]
_COMMAND = re.compile(r"(?<![\w/.-])storyrl\s+(.*)")
_ENDS = ("`", "(", "#", "->")


def _comments(path: Path) -> list[tuple[int, str]]:
    """(line number, comment text) of a YAML file, continuation lines (a
    trailing backslash) joined onto the line they continue."""
    out: list[tuple[int, str]] = []
    joining = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        found = re.search(r"(?:^|\s)#(.*)$", line)
        text = found.group(1).strip() if found else None
        if joining and text is not None:
            out[-1] = (out[-1][0], out[-1][1][:-1].rstrip() + " " + text)
        elif text is not None:
            out.append((number, text))
        joining = text is not None and text.endswith("\\")
    return out


def command_lines(text: str) -> list[list[str]]:
    """The ``storyrl ...`` command lines in a comment, as argv after
    ``storyrl``: cut at a closing backtick, a parenthesis, a comment or an
    arrow; ``[--opt]``, ``a | b`` and ``...`` placeholders unwrapped or
    dropped; sentence punctuation stripped. Prose (``storyrl does not``)
    is not a command line: its first word is not a command."""
    from storyrl.cli import main

    lines = []
    for found in _COMMAND.finditer(text):
        rest = found.group(1)
        for end in _ENDS:
            rest = rest.split(end)[0]
        argv = []
        for token in rest.split():
            stop = token[-1] in ".,;:)" and not token.endswith("...")
            token = token.strip("[]|").rstrip(".,;:)]")
            if token and token not in ("...", "|"):
                argv.append(token)
            if stop:
                break
        if argv and (argv[0] in main.commands or any(t.startswith("-") for t in argv)):
            lines.append(argv)
    return lines


COMMENT_COMMANDS = [(f"{path.relative_to(ROOT)}:{number}", argv)
                    for path in sorted((ROOT / "configs").rglob("*.yaml"))
                    for number, text in _comments(path) for argv in command_lines(text)]


def parse_problem(argv: list[str]) -> str | None:
    """None when ``storyrl ARGV`` names real commands and options, else what
    is wrong: the subcommands are resolved as click resolves them, then each
    ``-x``/``--name`` is looked up among the command's options (values and
    arguments are placeholders, not checked)."""
    import click

    from storyrl.cli import main

    command, ctx, rest = main, click.Context(main, info_name="storyrl"), list(argv)
    while isinstance(command, click.Group):
        sub = command.get_command(ctx, rest[0]) if rest else None
        if sub is None:
            return f"storyrl {ctx.command_path.removeprefix('storyrl').strip()}: no such command {rest[:1]}"
        command, ctx, rest = sub, click.Context(sub, parent=ctx, info_name=rest[0]), rest[1:]
    names = {name for param in command.get_params(ctx) if isinstance(param, click.Option)
             for name in (*param.opts, *param.secondary_opts)}
    for token in rest:
        if token == "--":
            break
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", token) and token.split("=")[0] not in names:
            return f"{ctx.command_path}: no such option {token.split('=')[0]}"
    return None


def test_the_comments_quote_command_lines():
    where = {w for w, _ in COMMENT_COMMANDS}
    assert {"configs/training/reward_model.yaml:2", "configs/training/reward_model.yaml:6",
            "configs/training/tapm.yaml:4", "configs/rl/ppo_tapm.yaml:6"} <= where
    argv = dict(COMMENT_COMMANDS)
    assert argv["configs/training/reward_model.yaml:6"] == [
        "score", "stories.jsonl", "-m", "reward_model", "--reward-model-model", "runs/reward_model/final", "-o",
        "scores.csv"]
    assert argv["configs/training/dpo.yaml:2"] == ["train", "dpo", "--config", "configs/training/dpo.yaml",
                                                   "--resume", "--overwrite"]
    assert "--image-root" in argv["configs/training/tapm.yaml:4"]  # the continuation line is part of it


@pytest.mark.parametrize(("where", "argv"), COMMENT_COMMANDS, ids=[w for w, _ in COMMENT_COMMANDS])
def test_every_command_line_in_the_config_comments_parses(where, argv):
    assert parse_problem(argv) is None


def test_the_parse_check_catches_wrong_options_and_commands():
    # The reward_model.yaml comment before issue 31: `score` has no --model.
    (argv,) = command_lines("final is a reward: storyrl score -m reward_model --model runs/reward_model/final")
    assert parse_problem(argv) == "storyrl score: no such option --model"
    assert parse_problem(["score", "-m", "reward_model", "--reward-model-model", "x", "-o", "s.csv"]) is None
    assert "no such command ['reward-models']" in parse_problem(["train", "reward-models", "--config", "x.yaml"])
    assert parse_problem(["train", "rl", "--model"]) is None  # an option's missing value is a placeholder
    assert command_lines("storyrl does not do it") == []
    assert command_lines("(storyrl train coherence, or the authors' checkpoint)") == [["train", "coherence"]]
