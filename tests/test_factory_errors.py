"""Break-review survivors: the dhm reward's human-score cache and options, the
reward factory's specs and files, and ConfigError's parts. Cheap rewards only
(dhm on the repetition dimension: no model)."""

from __future__ import annotations

import math

import pytest

from storyrl.config import Config, ConfigError, ConfigTypeError, option
from storyrl.rewards import build_reward, create_reward, load_reward_config

STORY = "The dog ran to the park. The dog played with a ball. Then the dog went home."
A, B, C = ("We went to the beach. The sea was blue and calm.", "A cake was on the table. Everyone sang for her.",
           "The city was loud at night. Lights shone on every street.")


def repetition_dhm(monkeypatch, **options):
    """A dhm reward on repetition alone and the (stories, context) of each
    call of its repetition component."""
    reward = create_reward("dhm", dimensions=["repetition"], **options)
    component = reward.component_rewards["repetition"]
    calls = []
    original = component.score

    def recording(stories, **context):
        calls.append((list(stories), context))
        return original(stories, **context)

    monkeypatch.setattr(component, "score", recording)
    return reward, calls


def human_calls(calls):
    """The references scored, one list per component call on references."""
    return [stories for stories, _ in calls if set(stories) & {A, B, C, "   "}]


# -- dhm -------------------------------------------------------------------------------------


def test_human_cache_keeps_the_most_recently_used(monkeypatch):
    reward, calls = repetition_dhm(monkeypatch, human_cache_size=2)
    for ref in (A, B, A, C):
        reward.score([STORY], reference=[ref])
    # A was used again after B, so B (least recently used) is the one pushed out.
    assert list(reward.human_cache) == [(None, A), (None, C)]
    assert human_calls(calls) == [[A], [B], [C]] and reward.stats["human_scored"] == 3
    reward.score([STORY], reference=[A])  # still cached
    assert reward.stats["human_scored"] == 3
    reward.score([STORY], reference=[B])  # scored again
    assert reward.stats["human_scored"] == 4 and human_calls(calls)[-1] == [B]


def test_human_cache_size_zero_keeps_nothing(monkeypatch):
    reward, calls = repetition_dhm(monkeypatch, human_cache_size=0)
    first = reward.score([STORY, STORY], reference=[A, A])
    assert len(reward.human_cache) == 0 and reward.stats["human_scored"] == 1  # once within the call
    again = reward.score([STORY], reference=[A])
    assert len(reward.human_cache) == 0 and reward.stats["human_scored"] == 2
    assert human_calls(calls) == [[A], [A]]
    assert again[0] == pytest.approx(first[0])


def test_story_noun_phrases_never_reach_the_human_story(monkeypatch):
    reward, calls = repetition_dhm(monkeypatch)
    nps = [["the dog", "a ball"]]
    reward.score([STORY], reference=[A], noun_phrases=nps)
    (human_ctx,) = [ctx for stories, ctx in calls if stories == [A]]
    (model_ctx,) = [ctx for stories, ctx in calls if stories == [STORY]]
    assert "noun_phrases" not in human_ctx and model_ctx["noun_phrases"] == nps
    # The human story's own, given as reference_noun_phrases, are its noun_phrases.
    reward, calls = repetition_dhm(monkeypatch)
    reward.score([STORY], reference=[A], noun_phrases=nps, reference_noun_phrases=[["the sea"]])
    (human_ctx,) = [ctx for stories, ctx in calls if stories == [A]]
    assert human_ctx["noun_phrases"] == [["the sea"]] and "reference_noun_phrases" not in human_ctx


@pytest.mark.parametrize("weight", [0, 0.0, -1.0])
def test_a_weight_must_be_positive(weight):
    with pytest.raises(ValueError, match=r"weights: 'repetition' must be a positive number"):
        create_reward("dhm", dimensions=["repetition"], weights={"repetition": weight})


def test_one_reference_under_two_story_ids_is_scored_for_each(monkeypatch):
    reward, calls = repetition_dhm(monkeypatch)
    reward.score([STORY, STORY], reference=[A, A], story_id=["s1", "s2"], images=[["1.png"], ["2.png"]])
    (human,) = [(stories, ctx) for stories, ctx in calls if A in stories]
    assert human[0] == [A, A] and human[1]["images"] == [["1.png"], ["2.png"]]  # each with its own images
    assert reward.stats["human_scored"] == 2 and set(reward.human_cache) == {("s1", A), ("s2", A)}


def test_a_whitespace_reference_is_no_human_story(monkeypatch):
    reward, calls = repetition_dhm(monkeypatch)
    got = reward.score([STORY, STORY], reference=["   ", A])
    assert math.isnan(got[0]) and not math.isnan(got[1])
    assert reward.stats["reasons"] == {"no human story": 1}
    assert human_calls(calls) == [[A]] and reward.stats["human_scored"] == 1


# -- the reward factory ----------------------------------------------------------------------


def test_an_unset_override_keeps_the_files_value(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("reward: repetition\nchunk_size: 3\n")
    assert load_reward_config(path, {"chunk_size": None}).chunk_size == 3
    assert load_reward_config(path, {"chunk_size": 5}).chunk_size == 5


def test_a_reward_by_its_alias():
    reward = build_reward("rouge-l")
    assert reward.name == "rouge_l" and type(reward) is type(build_reward("rouge_l"))


@pytest.mark.parametrize("load", [load_reward_config, lambda p: build_reward(str(p))])
def test_a_reward_key_that_is_not_a_name_is_a_one_line_config_error(tmp_path, load):
    path = tmp_path / "r.yaml"
    path.write_text("reward: [repetition]\n")
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message == f"{path}: a reward config is a mapping with a 'reward: <name>' key"
    assert "unhashable" not in message and "\n" not in message


# -- ConfigError -----------------------------------------------------------------------------


def test_named_keeps_source_and_option():
    error = ConfigError("bad", owner="Cls", source="f", option="o").named("x", "Cls")
    assert (error.source, error.option, error.owner, error.message) == ("f", "o", "x", "bad")
    assert str(error) == "f: x: bad"
    typed = ConfigTypeError("bad", source="f", option="o").named("x", source="g")
    assert isinstance(typed, TypeError) and (typed.source, typed.option) == ("g", "o")


def test_of_keeps_a_type_error_a_type_error():
    typed = ConfigError.of(TypeError("wrong type"))
    assert isinstance(typed, ConfigTypeError) and isinstance(typed, TypeError) and str(typed) == "wrong type"
    value = ConfigError.of(ValueError("bad value"))
    assert type(value) is ConfigError and not isinstance(value, TypeError)
    same = ConfigTypeError("x")
    assert ConfigError.of(same) is same


def test_an_error_read_through_two_files_names_both():
    inner = ConfigError("must be > 0", owner="reward 'repetition'", option="chunk_size", source="inner.yaml")
    outer = inner.from_source("outer.yaml")
    assert str(outer) == "outer.yaml: inner.yaml: reward 'repetition': must be > 0"
    assert outer.source == "outer.yaml" and outer.option == "chunk_size"
    # A type problem read from a file is the file's fault: a ValueError.
    assert not isinstance(ConfigTypeError("t", source="a").from_source("b"), TypeError)
    plain = ConfigError("m", owner="O", option="p").from_source("f.yaml")
    assert (str(plain), plain.owner, plain.option) == ("f.yaml: O: m", "O", "p")


def test_a_missing_required_option_is_a_type_error():
    from dataclasses import dataclass

    @dataclass
    class Needs(Config):
        name: str = option(help="Required.")
        size: int = option(1, "A size.")

    assert Needs.from_mapping({"name": "n"}).name == "n"
    with pytest.raises(ConfigTypeError, match="missing required option\\(s\\) 'name'") as info:
        Needs.from_mapping({"size": 2})
    assert isinstance(info.value, TypeError)
    with pytest.raises(ConfigError, match="^f.yaml: ") as info:  # from a file: the file's fault
        Needs.from_mapping({}, source="f.yaml")
    assert not isinstance(info.value, TypeError)
