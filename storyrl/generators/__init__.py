"""Story generators: records with images in, ``{story_id: story}`` out.

The interface is :class:`Generator` (``storyrl.generators.base``, with the
file formats); generators register in :data:`GENERATORS` and are created by
name with :func:`create_generator`; :func:`storyrl.generators.runs.generate_to_file`
writes a run's story file and sidecar. Families:

* ``prompting``: zero-shot prompting of vision-language models, with
  ``prompts`` (templates from ``configs/prompts/``), ``postprocess`` (the
  authors' cleaning), ``sequence_image`` (their one-image sequences) and
  ``engines`` (transformers, vLLM);
* ``tapm``: TAPM-style storytellers (visual encoder + language-model decoder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from storyrl.generators.base import Generations, Generator, GeneratorConfig
from storyrl.registry import Registry

__all__ = [
    "GENERATORS", "TAPM_MODEL_TYPE", "Generations", "Generator", "GeneratorConfig", "create_generator",
    "generator_for_model", "register_generator",
]

GENERATORS: Registry[type[Generator]] = Registry("generator")
GENERATORS.add("prompting", "storyrl.generators.prompting:PromptingGenerator",
               "Zero-shot prompting of a vision-language model (LLaVA-NeXT, LLaVA, BLIP-2, any chat VLM).")
GENERATORS.add("tapm", "storyrl.generators.tapm:TapmGenerator",
               "A trained TAPM-style storyteller (visual encoder + language-model decoder), one sentence per image.")


def register_generator(name: str | None = None, *, description: str | None = None):
    """Class decorator adding a :class:`Generator` subclass to :data:`GENERATORS`."""
    return GENERATORS.register(name, description=description)


#: ``model_type`` in the ``config.json`` of a trained TAPM-style model directory
TAPM_MODEL_TYPE = "storyrl_tapm"


def generator_for_model(model: str | os.PathLike) -> str:
    """The generator that runs ``model``: ``tapm`` for a directory holding a
    trained TAPM-style model, else ``prompting`` (a vision-language model by
    hub name or directory)."""
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (ValueError, OSError, AttributeError):
            model_type = None
        if model_type == TAPM_MODEL_TYPE:
            return "tapm"
    return "prompting"


def create_generator(name: str, **options: Any) -> Generator:
    """Instantiate a registered generator with validated options."""
    return GENERATORS.get(name)(**options)
