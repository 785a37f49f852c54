"""The generator seam (issue 9): a toy generator through the base class --
batching, failures recorded with their error (never as story text), the
JSON story set ``storyrl score`` reads, and the registry."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from storyrl.config import option
from storyrl.data import StoryRecord, load_stories
from storyrl.generators import GENERATORS, Generator, GeneratorConfig, create_generator, register_generator


@dataclass
class EchoConfig(GeneratorConfig):
    suffix: str = option("!", "Appended to each story.")


@register_generator()
class Echo(Generator):
    """Test generator: the record's story upper-cased; 'boom' in it fails."""

    name = "test_echo"
    config_class = EchoConfig

    def __init__(self, config=None, /, **options):
        super().__init__(config, **options)
        self.calls: list[int] = []

    def _generate_batch(self, records):
        self.calls.append(len(records))
        if any("boom" in r.story for r in records):
            raise RuntimeError("model exploded")
        return [r.story.upper() + self.suffix for r in records]


def _records(*texts):
    return [StoryRecord(f"s{i}", t, image_ids=[f"img{i}"]) for i, t in enumerate(texts)]


def test_generate_batches_and_records_failures_with_their_error(tmp_path):
    gen = create_generator("test_echo", batch_size=2, suffix="?")
    assert isinstance(gen, Echo) and gen.args == EchoConfig(batch_size=2, suffix="?")
    seen = []
    out = gen.generate(_records("a dog", "boom", "a cat"), progress=seen.append)
    assert out.stories == {"s0": "A DOG?", "s2": "A CAT?"}
    assert out.failures == {"s1": "RuntimeError: model exploded"}
    assert seen == [2, 1]
    assert gen.calls == [2, 1, 1, 1]  # the failing batch is retried record by record
    path = tmp_path / "stories.json"
    out.save(path)
    assert {r.story_id: r.story for r in load_stories(path)} == out.stories
    with pytest.raises(Exception, match="exists"):
        out.save(path)  # an existing story file is replaced only on request
    out.save(path, overwrite=True)
    assert json.loads(path.read_text()) == out.stories


def test_a_wrong_story_count_is_a_failure_not_a_shifted_story():
    class Short(Echo):
        def _generate_batch(self, records):
            return super()._generate_batch(records)[:1]

    out = Short(batch_size=3).generate(_records("a", "b", "c"))
    # Retried one by one: each single record gets its own story.
    assert out.stories == {"s0": "A!", "s1": "B!", "s2": "C!"} and not out.failures


def test_generator_options_are_validated():
    with pytest.raises(TypeError, match="generator 'test_echo': option 'batch_size'"):
        create_generator("test_echo", batch_size="2")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        Echo(batch_size=0)
    assert "test_echo" in GENERATORS.names() and GENERATORS.describe("test_echo").startswith("Test generator")
