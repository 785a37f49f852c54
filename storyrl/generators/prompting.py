"""Zero-shot story generation by prompting a vision-language model (d_HM
paper §4, App. A; reference notes, "Zero-shot prompting").

Settings:

* ``visual``: the whole image sequence as ONE image
  (:func:`storyrl.generators.sequence_image.sequence_image`, or the authors'
  ready PNGs from ``sequence_image_dir``) and a ``visual`` prompt asking for
  as many sentences as there are images; the story is the cleaned output.
* ``prev_sentence`` / ``all_sentences`` / ``no_context``: one call per image
  with a ``sentence`` prompt whose ``{context}`` is the sentence generated for
  the previous image, all sentences generated so far, or empty; the story is
  the outputs joined as the authors did (:func:`join_sentence_outputs`).

A batch of stories is generated together: all visual prompts in one call,
or, for the sentence settings, image position by position across the batch
(the authors made one call per story and image). ``chat_format`` wraps the
prompt: ``authors`` (``[INST] <image>\\n... [/INST]``, the d_HM script for
LLaVA-NeXT Mistral; outputs are decoded with the prompt and cut after the
last ``[/INST]`` as theirs were), ``template`` (the processor's chat
template), ``plain`` (the text alone, e.g. BLIP-2, whose processor inserts
the image's tokens itself; for a processor that expands an image token the
prompt must carry, as LLaVA's do, the token and a newline come first) or
``auto`` (``authors`` for LLaVA-NeXT with a Mistral decoder, else
``template`` when the processor has one, else ``plain``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from storyrl.config import option
from storyrl.data import StoryRecord
from storyrl.generators.base import Generator, GeneratorConfig
from storyrl.generators.postprocess import clean_generation, join_sentence_outputs
from storyrl.generators.prompts import PromptTemplate, load_prompts, mistral_inst
from storyrl.models.runtime import PRECISIONS
from storyrl.models.vlm import DEFAULT_VLM

__all__ = ["CHAT_FORMATS", "DEFAULT_PROMPTS", "SETTINGS", "PromptingConfig", "PromptingGenerator",
           "processor_image_token"]

SETTINGS = ("visual", "prev_sentence", "all_sentences", "no_context")
CHAT_FORMATS = ("auto", "authors", "template", "plain")
BACKENDS = ("transformers", "vllm")
#: The d_HM prompts P1-P3 (``configs/prompts/dhm.yaml`` of a source checkout).
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "configs" / "prompts" / "dhm.yaml"
_SIZE = re.compile(r"^([1-9]\d*)x([1-9]\d*)$")
#: Most pixels (width x height) ``sequence_image_size`` may ask for per image: 4096x4096. The sequence image
#: holds one such image per story image, and a VLM's processor shrinks it to a few hundred pixels anyway.
MAX_SEQUENCE_IMAGE_PIXELS = 4096 * 4096


@dataclass
class PromptingConfig(GeneratorConfig):
    model: str = option(DEFAULT_VLM, "Hub name or local directory of an image-text-to-text model.")
    revision: str | None = option(None, "Hub revision of the model (branch, tag or commit).")
    setting: str = option("visual", "Context: the whole sequence as one image, or one sentence per image with the "
                          "previous sentence, all previous sentences or no text as context.", choices=SETTINGS)
    prompt: str = option("P3", "Prompt name in the prompts file (P1, P2, P3 in the d_HM prompts).")
    prompts_file: str | None = option(None, "Prompt templates YAML (default: configs/prompts/dhm.yaml).", path="file")
    fill_count: bool = option(True, "Fill the sentence count in as a word; false sends the authors' unfilled 'N' "
                              "(their published stories were made so).")
    chat_format: str = option("auto", "How the prompt is wrapped for the model (see storyrl.generators.prompting).",
                              choices=CHAT_FORMATS)
    image_root: str | None = option(None, "Directory that image ids and relative image paths are resolved in.",
                                    path="dir")
    sequence_image_size: str | None = option(None, "Resize each image to WIDTHxHEIGHT before building the "
                                             "sequence image (the authors: 256x256 for VIST; VWP frames kept); "
                                             "at most 16,777,216 pixels (4096x4096).")
    sequence_image_dir: str | None = option(None, "Ready sequence images, <story_id>.png or seq_<story_id>.png "
                                            "(the authors' PNGs), used for the visual setting.", path="dir")
    max_new_tokens: int = option(500, "Most new tokens per generation.", min=1)
    do_sample: bool = option(False, "Sample instead of greedy decoding.")
    temperature: float = option(1.0, "Sampling temperature (finite, >= 0).", min=0.0)
    top_p: float = option(1.0, "Nucleus sampling mass.", min=0.0, max=1.0)
    top_k: int = option(50, "Top-k sampling (0: off).", min=0)
    num_beams: int = option(1, "Beam search width (transformers backend).", min=1)
    seed: int = option(0, "Random seed of the sampling.")
    device: str | None = option(None, "Device (default: CUDA when available, else CPU).")
    precision: str = option("auto", "Weights dtype: auto = fp16 on CUDA, fp32 on CPU.", choices=PRECISIONS)
    load_in_4bit: bool = option(False, "Quantise the model to 4 bits (bitsandbytes, CUDA).")
    backend: str = option("transformers", "Generation engine; vllm needs the vllm extra.", choices=BACKENDS)

    runtime_options: ClassVar[tuple[str, ...]] = ("batch_size", "device", "image_root", "sequence_image_dir")

    def _problems(self) -> list[str]:
        problems = []
        if self.sequence_image_size is not None and not _SIZE.match(self.sequence_image_size):
            problems.append(f"sequence_image_size must look like 256x256, got {self.sequence_image_size!r}")
        elif self.sequence_image_size is not None:
            w, h = map(int, _SIZE.match(self.sequence_image_size).groups())
            if w * h > MAX_SEQUENCE_IMAGE_PIXELS:
                problems.append(f"sequence_image_size {self.sequence_image_size} is {w * h:,} pixels; at most "
                                f"{MAX_SEQUENCE_IMAGE_PIXELS:,} (MAX_SEQUENCE_IMAGE_PIXELS, 4096x4096)")
        return problems

    @property
    def kind(self) -> str:
        """The kind of prompt the setting uses."""
        return "visual" if self.setting == "visual" else "sentence"

    def template(self) -> PromptTemplate:
        path = self.prompts_file or DEFAULT_PROMPTS
        templates = load_prompts(path)
        try:
            return templates[(self.kind, self.prompt)]
        except KeyError:
            known = sorted(name for kind, name in templates if kind == self.kind)
            raise ValueError(f"{path}: no {self.kind} prompt named {self.prompt!r} (it has {', '.join(known)})") from None


class PromptingGenerator(Generator):
    """Stories from a vision-language model prompted zero-shot (module docs)."""

    name = "prompting"
    config_class: ClassVar[type[PromptingConfig]] = PromptingConfig

    def __init__(self, config: PromptingConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        self._template = self.args.template()  # a bad prompts file fails here, before any model loads
        self._engine = None
        self._image_prefix = ""  # the plain format's image token, when the processor needs one in the text

    def _setup(self) -> None:
        if self._engine is not None:
            return
        from storyrl.generators.engines import Decoding, create_engine

        a = self.args
        decoding = Decoding(a.max_new_tokens, a.do_sample, a.temperature, a.top_p, a.top_k, a.num_beams, a.seed)
        self._engine = create_engine(a.backend, model=a.model, revision=a.revision, device=a.device,
                                     precision=a.precision, load_in_4bit=a.load_in_4bit, decoding=decoding)
        # decided (or refused) at start, not story by story
        self._image_prefix = self._plain_image_prefix() if self.chat_format == "plain" else ""

    def _plain_image_prefix(self) -> str:
        """The processor's image token and a newline when the model needs the
        token in its prompt and the processor does not insert it itself, else
        "" (BLIP-2 prepends its query tokens; a model without an image token)."""
        processor = self._engine.processor
        token = processor_image_token(processor)
        if token is None:
            if self._engine.image_token_id is not None:
                raise ValueError(
                    f"model {self.args.model}: chat format 'plain' cannot place the image (the model needs an image "
                    "token and its processor names none); choose --chat-format template with a processor that has a "
                    "chat template, or --chat-format authors for LLaVA-NeXT")
            return ""
        return "" if _inserts_image_tokens(processor, token) else f"{token}\n"

    # -- prompts ----------------------------------------------------------------
    @property
    def chat_format(self) -> str:
        """The resolved chat format (``auto`` decided by the loaded model)."""
        if self.args.chat_format != "auto":
            return self.args.chat_format
        self._setup()
        engine = self._engine
        if engine.family == "llava_next" and engine.text_model_type == "mistral":
            return "authors"
        processor = engine.processor
        has_template = getattr(processor, "chat_template", None) or getattr(
            getattr(processor, "tokenizer", None), "chat_template", None)
        return "template" if has_template else "plain"

    def prompt_text(self, n_images: int | None = None, context: str = "") -> str:
        """The template's text for one call, before chat wrapping."""
        return self._template.render(n=n_images, context=context, fill_count=self.args.fill_count)

    def wrap(self, text: str) -> str:
        """``text`` as the model's input string, with its image placeholder."""
        fmt = self.chat_format
        if fmt == "authors":
            return mistral_inst(text)
        if fmt == "template":
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            return self._engine.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self._setup()
        if self._image_prefix and self._image_prefix.strip() not in text:  # one image token per image
            return self._image_prefix + text
        return text

    def metadata(self) -> dict[str, Any]:
        self._setup()
        return {
            **super().metadata(),
            "model_commit": self._engine.commit,
            "chat_format": self.chat_format,
            "prompt_template": self._template.text,
            "prompt_example": self.wrap(self.prompt_text(5 if self.args.kind == "visual" else None)),
        }

    # -- generation ---------------------------------------------------------------
    def _generate_batch(self, records: list[StoryRecord]) -> list[str]:
        from storyrl.images import resolve_images

        sequences = [resolve_images(r.images, r.image_ids, self.args.image_root) for r in records]
        if self.args.setting == "visual":
            images = [self._sequence_image(r, seq) for r, seq in zip(records, sequences)]
            prompts = [self.wrap(self.prompt_text(len(seq))) for seq in sequences]
            return [clean_generation(t) for t in self._call(prompts, images)]
        return self._sentence_by_sentence(sequences)

    def _sentence_by_sentence(self, sequences: list[list[Any]]) -> list[str]:
        from storyrl.images import Region, load_region

        sentences: list[list[str]] = [[] for _ in sequences]
        for position in range(max(map(len, sequences))):
            todo = [i for i, seq in enumerate(sequences) if position < len(seq)]
            prompts = [self.wrap(self.prompt_text(context=self._context(sentences[i]))) for i in todo]
            images = [load_region(Region(sequences[i][position])) for i in todo]
            for i, text in zip(todo, self._call(prompts, images)):
                sentences[i].append(clean_generation(text))
        return [join_sentence_outputs(" ".join(s)) for s in sentences]

    def _context(self, previous: list[str]) -> str:
        if self.args.setting == "no_context" or not previous:
            return ""
        return previous[-1] if self.args.setting == "prev_sentence" else " ".join(previous)

    def _sequence_image(self, record: StoryRecord, sequence: list[Any]):
        from PIL import Image

        from storyrl.generators.sequence_image import sequence_image

        if self.args.sequence_image_dir is not None:
            root = Path(self.args.sequence_image_dir)
            for name in (f"{record.story_id}.png", f"seq_{record.story_id}.png"):
                if (root / name).is_file():
                    return Image.open(root / name).convert("RGB")
        size = None
        if self.args.sequence_image_size is not None:
            w, h = _SIZE.match(self.args.sequence_image_size).groups()
            size = (int(w), int(h))
        return sequence_image(sequence, size=size)

    def _call(self, prompts: list[str], images: list[Any]) -> list[str]:
        self._setup()
        return self._engine.generate(prompts, images, decode_prompt=self.chat_format == "authors")


def processor_image_token(processor) -> str | None:
    """The image placeholder token of a processor (``processor.image_token``,
    else its tokenizer's), or None."""
    for owner in (processor, getattr(processor, "tokenizer", None)):
        token = getattr(owner, "image_token", None)
        token = getattr(token, "content", token)  # an AddedToken
        if isinstance(token, str) and token:
            return token
    return None


def _inserts_image_tokens(processor, token: str) -> bool:
    """Whether ``processor`` puts image tokens in the input ids of a text
    without ``token`` (BLIP-2's query tokens) rather than expanding the token
    where the text has it (LLaVA's)."""
    from PIL import Image

    tokenizer = getattr(processor, "tokenizer", processor)
    token_id = tokenizer.convert_tokens_to_ids(token)
    try:
        ids = processor(images=[Image.new("RGB", (32, 32))], text=["story"], return_tensors="pt")["input_ids"]
    except (ValueError, TypeError, IndexError, KeyError, RuntimeError):  # some refuse a text without the token
        return False
    return bool((ids == token_id).any())
