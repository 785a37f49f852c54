"""README's layering, checked: every ``import`` in storyrl (module level or
inside a function; ``if TYPE_CHECKING:`` blocks aside) points to the
importer's own layer or one below it. A new top-level module or package must
be given a layer in LAYERS before this test passes."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import storyrl

ROOT = Path(storyrl.__file__).parent

#: Low to high; a module may import its own layer and those below, never above.
#: Keys are storyrl's top-level modules and packages (a package's
#: subpackages share its layer); "__init__" is the package root.
LAYERS = [
    # base: formats, options, registries and helpers that know no metric
    ("base", {"__init__", "compat", "config", "registry", "console", "text", "data", "datasets", "input_text",
              "output_files", "assets", "word_weights", "images", "judgements"}),
    ("models", {"models"}),
    # noun_phrases: the grounding rewards' spaCy extraction (uses models' caches, raises RewardError)
    ("rewards", {"rewards", "noun_phrases"}),
    ("generators", {"generators"}),
    ("training", {"training"}),
    ("eval", {"eval"}),
    ("integrations", {"integrations"}),
    # doctor: the `storyrl doctor` checks (rewards, generators, a sweep's plan)
    ("cli", {"cli", "__main__", "doctor"}),
]
RANK = {unit: rank for rank, (_, units) in enumerate(LAYERS) for unit in units}
LAYER_NAME = {unit: name for name, units in LAYERS for unit in units}

#: Upward imports that are known and accepted, each with why: (importing
#: module, imported module) -> reason. Empty today; an entry here must say why
#: the import cannot point down instead.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """storyrl.eval.dhm -> "eval"; storyrl -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST):
    """Every node, skipping the bodies of ``if TYPE_CHECKING:`` (not their else)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def storyrl_imports(source: str, module: str, is_package: bool, submodules=frozenset()) -> list[tuple[int, str, str]]:
    """(line, imported storyrl module, the statement) of each storyrl import in
    ``source``, the module ``module``. ``from storyrl import x`` imports the
    submodule ``storyrl.x`` when x is one of ``submodules``."""
    found = []
    for node in _nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in submodules else base for a in node.names]
        else:
            continue
        statement = ast.get_source_segment(source, node) or ""
        found += [(node.lineno, t, " ".join(statement.split())) for t in targets
                  if t == "storyrl" or t.startswith("storyrl.")]
    return sorted(found)


def upward_imports(source: str, module: str, is_package: bool = False, submodules=frozenset()) -> list[str]:
    """The upward imports in ``source`` (module ``module``), one line each:
    ``module:line: statement (layer -> higher layer)``."""
    unit = unit_of(module)
    problems = []
    for line, target, statement in storyrl_imports(source, module, is_package, submodules):
        to = unit_of(target)
        if to not in RANK:
            problems.append(f"{module}:{line}: {statement} (storyrl/{to} has no layer: add it to LAYERS)")
        elif RANK[to] > RANK[unit] and (module, target) not in ALLOWED_UPWARD:
            problems.append(f"{module}:{line}: {statement} ({LAYER_NAME[unit]} -> {LAYER_NAME[to]}, a higher layer)")
    return problems


def _sources():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _submodules() -> frozenset[str]:
    return frozenset(module_name(p) for p in _sources())


def test_every_module_has_a_layer():
    units = {unit_of(module_name(p)) for p in _sources()}
    missing = sorted(units - set(RANK))
    assert not missing, f"storyrl modules with no layer (add them to LAYERS in {__file__}): {missing}"


def test_no_import_points_up():
    submodules = _submodules()
    problems = []
    for path in _sources():
        module = module_name(path)
        problems += upward_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py", submodules)
    assert not problems, "upward imports (layers, low to high: " + " < ".join(n for n, _ in LAYERS) + "):\n" + \
        "\n".join(problems)


def test_allow_list_entries_are_still_needed():
    # A fixed upward import leaves its entry behind; remove it so the list cannot hide a new one.
    submodules = _submodules()
    seen = set()
    for path in _sources():
        module = module_name(path)
        for _, target, _ in storyrl_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py",
                                            submodules):
            seen.add((module, target))
    assert not set(ALLOWED_UPWARD) - seen


# -- the training folder's two audiences ----------------------------------------------

#: storyrl/training's folders, one per audience; neither imports the other.
AUDIENCES = ("storyrl.training.judges", "storyrl.training.storyteller")
#: storyrl/training's own modules, shared by both audiences: they import neither
#: (the TRAINERS registry in __init__ names the trainers by strings, not imports).
SHARED_TRAINING = {f"storyrl.training.{name}" for name in
                   ("accelerators", "checkpoints", "config", "guards", "loop", "model_card", "runs")} | {
                       "storyrl.training"}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def audience_imports(source: str, module: str, is_package: bool = False, submodules=frozenset()) -> list[str]:
    """The imports in ``source`` (module ``module``) that cross storyrl/training's
    audiences: judges <-> storyteller, or a shared module -> either."""
    own = next((a for a in AUDIENCES if _within(module, a)), None)
    if own is None and module not in SHARED_TRAINING:
        return []
    forbidden = [a for a in AUDIENCES if a != own]
    return [f"{module}:{line}: {statement} ({own or 'shared training'} -> {a})"
            for line, target, statement in storyrl_imports(source, module, is_package, submodules)
            for a in forbidden if _within(target, a)]


def test_the_training_audiences_stay_apart():
    submodules = _submodules()
    training = [p for p in _sources() if module_name(p).startswith("storyrl.training")]
    # Every module of storyrl/training is in one audience or named shared, so a new one is placed on purpose.
    unplaced = sorted(m for m in map(module_name, training)
                      if m not in SHARED_TRAINING and not any(_within(m, a) for a in AUDIENCES))
    assert not unplaced, f"storyrl/training modules in neither judges/, storyteller/ nor SHARED_TRAINING: {unplaced}"
    problems = []
    for path in training:
        problems += audience_imports(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py",
                                     submodules)
    assert not problems, "imports across storyrl/training's audiences:\n" + "\n".join(problems)


def test_the_audience_checker_finds_crossings_in_every_form():
    subs = {"storyrl.training.storyteller", "storyrl.training.judges", "storyrl.training.judges.vrank"}
    source = textwrap.dedent("""
        from storyrl.training.storyteller.config import StorytellerConfig
        def late():
            import storyrl.training.storyteller.rl.train
        from storyrl.training import storyteller
        from ..storyteller import sft
        from storyrl.training import Trainer, loop
        from storyrl.training.judges.rovist_vg_data import read
    """)
    found = audience_imports(source, "storyrl.training.judges.coherence", submodules=subs)
    assert [p.split(": ", 1)[0] for p in found] == [f"storyrl.training.judges.coherence:{n}" for n in (2, 4, 5, 6)]
    assert found[0].endswith("(storyrl.training.judges -> storyrl.training.storyteller)")
    # The other way, and a shared module importing either; a module outside storyrl/training is not checked.
    assert audience_imports("from storyrl.training.judges import vrank", "storyrl.training.storyteller.dpo",
                            submodules=subs)
    assert len(audience_imports("import storyrl.training.judges.vrank\nimport storyrl.training.storyteller",
                                "storyrl.training.loop")) == 2
    assert audience_imports("from storyrl.training.storyteller import X", "storyrl.training", is_package=True)
    assert audience_imports("from storyrl.training.storyteller import X", "storyrl.cli.pairs") == []


# -- the checker itself --------------------------------------------------------------

SYNTHETIC = textwrap.dedent("""
    from __future__ import annotations
    from typing import TYPE_CHECKING
    import numpy
    from storyrl.config import option
    from storyrl.models.runtime import PRECISIONS
    from . import base

    if TYPE_CHECKING:
        from storyrl.eval.sweep import SweepConfig

    def late():
        from storyrl.training.loop import train
        import storyrl.cli

    from .. import generators
    from storyrl import eval as e, __version__
""")


def test_checker_finds_upward_imports_inside_functions_and_relative_ones():
    problems = upward_imports(SYNTHETIC, "storyrl.rewards.fake",
                              submodules={"storyrl.eval", "storyrl.generators", "storyrl.rewards.base"})
    lines = [p.split(": ", 1)[0] for p in problems]
    # training (in a function), cli, the relative ``..generators`` and ``from storyrl import eval``;
    # not the TYPE_CHECKING import, config/models (below), the relative ``.base`` (same layer) or __version__.
    assert lines == ["storyrl.rewards.fake:13", "storyrl.rewards.fake:14", "storyrl.rewards.fake:16",
                     "storyrl.rewards.fake:17"]
    assert "from storyrl.training.loop import train (rewards -> training, a higher layer)" in problems[0]
    assert "import storyrl.cli (rewards -> cli" in problems[1]
    assert "(rewards -> generators" in problems[2]
    assert "(rewards -> eval" in problems[3]


def test_checker_accepts_same_and_lower_layers_and_names_an_unknown_unit():
    assert upward_imports("from storyrl.rewards.base import Reward\nimport storyrl.models", "storyrl.eval.x") == []
    assert upward_imports("from storyrl.eval import dhm", "storyrl.eval.dhm") == []
    (problem,) = upward_imports("import storyrl.newthing", "storyrl.config")
    assert "storyrl/newthing has no layer" in problem


def test_the_type_checking_else_branch_is_checked():
    source = "if TYPE_CHECKING:\n    import storyrl.cli\nelse:\n    import storyrl.eval\n"
    (problem,) = upward_imports(source, "storyrl.models.x")
    assert problem.startswith("storyrl.models.x:4: import storyrl.eval (models -> eval")


# -- what importing loads -------------------------------------------------------------

def _run(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (nothing imported yet)."""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


HEAVY = ("storyrl.eval.ablation", "storyrl.eval.sweep", "storyrl.generators", "storyrl.training")


@pytest.mark.parametrize("code", [
    "import storyrl.eval",
    "import storyrl.rewards.dhm",
    "from storyrl.rewards import create_reward; create_reward('dhm', dimensions=['repetition'])",
    "import storyrl.integrations; storyrl.integrations.score_stories",
])
def test_importing_loads_no_sweep_ablation_generator_or_trainer(code):
    check = f"import sys; {code}; print([m for m in {HEAVY!r} if m in sys.modules])"
    assert _run(check) == "[]"


def test_the_training_packages_load_no_torch_or_trl():
    # `from storyrl.training.storyteller import StorytellerConfig` is how configs and the CLI read the options.
    check = ("import sys; import storyrl.training, storyrl.training.judges; "
             "from storyrl.training.storyteller import StorytellerConfig; "
             "print([m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules])")
    assert _run(check) == "[]"


def test_the_dhm_reward_loads_no_eval_module():
    check = ("import sys; from storyrl.rewards import create_reward; create_reward('dhm'); "
             "print(sorted(m for m in sys.modules if m.startswith('storyrl.eval')))")
    assert _run(check) == "[]"


def test_every_public_eval_name_resolves_to_its_definition():
    import storyrl.eval as ev

    homes = {"AblationConfig": "ablation_config", "AblationResult": "ablation_report", "run_ablation": "ablation",
             "DHM_DIMENSIONS": "dhm", "DhmResult": "dhm", "dhm": "dhm", "OriginalVsRandom": "grounding",
             "original_vs_random": "grounding", "score_to_file": "scoring", "SweepConfig": "sweep",
             "SweepResult": "sweep", "run_sweep": "sweep"}
    assert set(ev.__all__) == set(homes)
    for name, home in homes.items():
        module = importlib.import_module(f"storyrl.eval.{home}")
        assert getattr(ev, name) is getattr(module, name), name
    # The submodule ``storyrl.eval.dhm`` being imported does not hide the function of that name.
    importlib.import_module("storyrl.eval.dhm")
    from storyrl.eval import dhm

    assert callable(dhm) and dhm.__module__ == "storyrl.eval.dhm"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ev.nothing  # noqa: B018


def test_every_public_integrations_name_is_the_scoring_modules():
    import storyrl.integrations as pkg
    from storyrl.integrations import scoring

    assert set(pkg.__all__) == set(scoring.__all__)
    for name in pkg.__all__:
        assert getattr(pkg, name) is getattr(scoring, name), name
    from storyrl.rewards.base import CONTEXT_KEYS

    assert pkg.CONTEXT_KEYS is CONTEXT_KEYS
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pkg.nothing  # noqa: B018


@pytest.mark.parametrize("package", ["storyrl.training", "storyrl.training.storyteller", "storyrl.training.judges"])
def test_every_name_a_package_exports_is_importable(package):
    """``from package import *`` works: each name of ``__all__`` is there (the
    storyteller package re-exports config.py's names after the split)."""
    module = importlib.import_module(package)
    missing = [name for name in getattr(module, "__all__", []) if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names {missing}, which it does not define"
    namespace: dict = {}
    exec(f"from {package} import *", namespace)  # noqa: S102 - the statement under test
    assert set(getattr(module, "__all__", [])) <= set(namespace)


def test_each_trainers_help_names_a_config_file_that_exists():
    from click.testing import CliRunner

    from storyrl.cli import main
    # storyrl's own trainers, as storyrl/training/__init__.py registers them (other tests
    # register toy trainers in the same process registry)
    names = re.findall(r'TRAINERS\.add\(\s*"(\w+)"', (ROOT / "training" / "__init__.py").read_text(encoding="utf-8"))
    assert len(names) >= 9, names
    for name in names:
        result = CliRunner().invoke(main, ["train", name, "--help"])
        assert result.exit_code == 0, result.output
        named = re.findall(r"configs/[\w/.-]+?\.yaml", " ".join(result.output.split()))
        assert named, f"storyrl train {name} --help names no config file"
        for path in named:
            assert (ROOT.parent / path).is_file(), f"storyrl train {name} --help names {path}, which is not there"
