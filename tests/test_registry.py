"""The one registry mechanism (issue 9): lazy import paths, aliases,
descriptions; the reward, trainer and generator registries on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from storyrl.registry import Registry


def test_lazy_entries_are_imported_on_first_get(tmp_path, monkeypatch):
    (tmp_path / "lazy_thing.py").write_text("class Thing:\n    '''A thing.'''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_thing", raising=False)
    registry = Registry("widget")
    registry.add("thing", "lazy_thing:Thing", "Things, lazily.", aliases=("the-thing",))
    assert registry.names() == ["thing"] and registry.describe("the-thing") == "Things, lazily."
    assert "lazy_thing" not in sys.modules
    cls = registry.get("the-thing")
    assert cls.__name__ == "Thing" and "lazy_thing" in sys.modules and registry.get("thing") is cls
    assert "the-thing" in registry and "nope" not in registry
    with pytest.raises(KeyError, match="unknown widget 'nope'; available: thing"):
        registry.get("nope")
    with pytest.raises(ValueError, match="needs a description"):
        registry.add("other", "lazy_thing:Thing")


def test_register_decorator_uses_name_and_docstring():
    registry = Registry("widget")

    @registry.register()
    class Gadget:
        """Does gadget things.

        More text."""

        name = "gadget"

    assert registry.get("gadget") is Gadget and registry.describe("gadget") == "Does gadget things."
    with pytest.raises(ValueError, match="needs a name"):
        registry.register()(type("Nameless", (), {}))


def test_listing_rewards_and_trainers_imports_no_component():
    code = textwrap.dedent("""
        import sys
        from storyrl.rewards import REWARDS
        from storyrl.training import TRAINERS
        lines = [REWARDS.describe(n) for n in REWARDS.names()] + [TRAINERS.describe(n) for n in TRAINERS.names()]
        assert all(lines), lines
        loaded = [m for m in sys.modules if m.startswith(("storyrl.rewards.", "storyrl.training.")) or m == "torch"]
        print(sorted(loaded))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['storyrl.rewards.base']"


def test_generated_help_imports_no_model_library():
    # score's options come from every reward's config; train's list from the
    # registry: neither may load torch and friends.
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from storyrl.cli import main
        for args in (["score", "--help"], ["train", "--help"], ["rewards"], ["rewards", "rovist_vg"]):
            assert CliRunner().invoke(main, args).exit_code == 0, args
        print([m for m in ("torch", "transformers", "open_clip", "spacy", "timm") if m in sys.modules])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_storyrl_rewards_lists_descriptions_and_a_rewards_options():
    from storyrl.cli import main
    from storyrl.config import option_info
    from storyrl.rewards import REWARDS
    from storyrl.rewards.coherence import CoherenceConfig

    result = CliRunner().invoke(main, ["rewards"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == REWARDS.names()
    for line in lines:
        name, description = line.split(None, 1)
        assert description == REWARDS.describe(name)
    result = CliRunner().invoke(main, ["rewards", "coherence"])
    assert result.exit_code == 0
    for info in option_info(CoherenceConfig):
        assert any(row.split()[0] == info.name for row in result.output.splitlines()[3:]), info.name
    result = CliRunner().invoke(main, ["rewards", "nope"])
    assert result.exit_code == 1 and "unknown reward 'nope'" in result.output


def test_trainer_and_reward_aliases_resolve():
    from storyrl.rewards import REWARDS, create_reward
    from storyrl.training import TRAINERS

    assert create_reward("rovist-vg").name == "rovist_vg" and REWARDS.resolve("rovist-vg") == "rovist_vg"
    assert TRAINERS.resolve("rovist-vg") == "rovist_vg" and "rovist-vg" not in TRAINERS.names()


def test_add_refuses_to_overwrite_a_name_or_alias_unless_replace():
    registry = Registry("widget")
    first, second = type("First", (), {}), type("Second", (), {})
    registry.add("thing", first, "First.", aliases=("the-thing",))
    for name, aliases in (("thing", ()), ("the-thing", ()), ("other", ("thing",)), ("other", ("the-thing",))):
        with pytest.raises(ValueError, match="widget '.*' is already registered .*replace=True"):
            registry.add(name, second, "Second.", aliases=aliases)
    assert registry.get("thing") is first and "other" not in registry  # nothing half-added
    registry.add("thing", second, "Second.", replace=True)
    assert registry.get("thing") is second and registry.describe("thing") == "Second."
    registry.add("the-thing", first, "First again.", replace=True)  # an alias replaced by a name of its own
    assert registry.get("the-thing") is first and registry.get("thing") is second


def test_register_decorator_refuses_a_taken_name():
    registry = Registry("widget")
    registry.register()(type("Gadget", (), {"name": "gadget", "__doc__": "One."}))
    with pytest.raises(ValueError, match="already registered"):
        registry.register()(type("Gadget2", (), {"name": "gadget", "__doc__": "Two."}))
    replacement = registry.register(replace=True)(type("Gadget3", (), {"name": "gadget", "__doc__": "Three."}))
    assert registry.get("gadget") is replacement


@pytest.mark.parametrize("package, registry_name", [("storyrl.rewards", "REWARDS"),
                                                    ("storyrl.generators", "GENERATORS")])
def test_every_registry_key_is_its_class_name(package, registry_name):
    import importlib

    registry = getattr(importlib.import_module(package), registry_name)
    for key in registry.names():
        assert registry.get(key).name == key, (registry_name, key)
