"""Story generators: records with images in, ``{story_id: story}`` out.

The interface is :class:`Generator` (``storyrl.generators.base``, with the
file formats); generators register in :data:`GENERATORS` and are created by
name with :func:`create_generator`. Zero-shot VLM prompting and TAPM-style
models go here, one module per generator family. Prompting parts so far:
``prompts`` (templates from ``configs/prompts/``), ``postprocess`` (the
authors' cleaning) and ``sequence_image`` (their one-image sequences).
"""

from __future__ import annotations

from typing import Any

from storyrl.generators.base import Generations, Generator, GeneratorConfig
from storyrl.registry import Registry

__all__ = ["GENERATORS", "Generations", "Generator", "GeneratorConfig", "create_generator", "register_generator"]

GENERATORS: Registry[type[Generator]] = Registry("generator")
GENERATORS.add("prompting", "storyrl.generators.prompting:PromptingGenerator",
               "Zero-shot prompting of a vision-language model (LLaVA-NeXT, LLaVA, BLIP-2, any chat VLM).")
GENERATORS.add("tapm", "storyrl.generators.tapm:TapmGenerator",
               "A trained TAPM-style storyteller (visual encoder + language-model decoder), one sentence per image.")


def register_generator(name: str | None = None, *, description: str | None = None):
    """Class decorator adding a :class:`Generator` subclass to :data:`GENERATORS`."""
    return GENERATORS.register(name, description=description)


def create_generator(name: str, **options: Any) -> Generator:
    """Instantiate a registered generator with validated options."""
    return GENERATORS.get(name)(**options)
