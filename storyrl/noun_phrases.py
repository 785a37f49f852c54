"""The phrases GROOViST aligns with image regions.

The authors' procedure (``extract_nphrases.py`` of the GROOViST release):

1. split the story into sentences with NLTK's Punkt ``sent_tokenize``
   (:func:`storyrl.text.split_sentences` reproduces it without NLTK data);
2. in each sentence replace the VIST placeholders ``[male]``, ``[female]``,
   ``[location]``, ``[organization]`` by the bare word;
3. parse the sentence with spaCy ``en_core_web_trf`` and take the lower-cased
   text of ``doc.noun_chunks``, dropping repeats within the sentence (order kept);
4. concatenate over the sentences (repeats *across* sentences are kept).

Before scoring, repeats across the story and phrases that are pronouns are
dropped (:func:`scoring_phrases`). :class:`PhraseExtractor` does 1-4 for many
stories with one batched ``nlp.pipe`` call and a per-sentence cache, so an RL
loop that keeps scoring the same human story, or repeated candidates, parses
each distinct sentence once.

spaCy is imported only when a pipeline is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from storyrl.assets import asset_path
from storyrl.models.caches import LruDict
from storyrl.text import split_sentences

__all__ = [
    "DEFAULT_PIPELINE",
    "PLACEHOLDERS",
    "UNITS",
    "PhraseExtractor",
    "PipelineNotInstalled",
    "check_reward_pipeline",
    "require_pipeline",
    "load_pipeline",
    "load_pronouns",
    "replace_placeholders",
    "scoring_phrases",
    "sentence_phrases",
]

#: VIST anonymisation placeholders and what the authors replace them with
#: (applied in this order, with ``str.replace``).
PLACEHOLDERS: dict[str, str] = {
    "[male]": "male",
    "[female]": "female",
    "[location]": "location",
    "[organization]": "organization",
}

DEFAULT_PIPELINE = "en_core_web_trf"

#: "noun_phrases": spaCy noun chunks (GROOViST); "nouns": single NOUN/PROPN
#: tokens (the paper's "-NPs +Ns" ablation).
UNITS = ("noun_phrases", "nouns")

# Components that do not change the tagger's/parser's output, so skipping them
# saves time without changing the phrases.
_UNNEEDED_COMPONENTS = ["ner", "lemmatizer"]

_PIPELINES: dict[str, Any] = {}


class PipelineNotInstalled(RuntimeError):
    """The spaCy pipeline (or spaCy itself) is not installed."""


def replace_placeholders(sentence: str) -> str:
    for placeholder, word in PLACEHOLDERS.items():
        if placeholder in sentence:
            sentence = sentence.replace(placeholder, word)
    return sentence


def load_pipeline(name: str = DEFAULT_PIPELINE):
    """``spacy.load(name)`` without the components noun chunks and POS do not
    need, loaded once per process and name.

    The reference calls ``spacy.prefer_gpu()`` first; call it yourself before the
    first load to parse on a GPU.
    """
    nlp = _PIPELINES.get(name)
    if nlp is not None:
        return nlp
    install = f"python -m spacy download {name}"
    try:
        import spacy
    except ImportError as exc:
        raise PipelineNotInstalled(
            f"spaCy pipeline {name!r} needs spaCy, which is not installed: pip install spacy, then {install}"
        ) from exc
    try:
        # disable= tolerates names a pipeline does not have.
        nlp = spacy.load(name, disable=_UNNEEDED_COMPONENTS)
    except OSError as exc:  # spaCy's E050: no such package or data directory
        raise PipelineNotInstalled(
            f"spaCy pipeline {name!r} is not installed; install it with: {install} ({exc})"
        ) from exc
    _PIPELINES[name] = nlp
    return nlp


def require_pipeline(name: str = DEFAULT_PIPELINE) -> None:
    """Raise :class:`PipelineNotInstalled` (one line, naming the pipeline and
    ``python -m spacy download NAME``) when :func:`load_pipeline` would fail
    because spaCy or the pipeline is not installed. Nothing is loaded: the
    check looks for the packages only (a local pipeline directory passes)."""
    from importlib.util import find_spec
    from pathlib import Path

    if name in _PIPELINES or Path(name).expanduser().is_dir():
        return

    def installed(module: str) -> bool:
        try:
            return find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    install = f"python -m spacy download {name}"
    if not installed("spacy"):
        raise PipelineNotInstalled(
            f"spaCy pipeline {name!r} needs spaCy, which is not installed: pip install spacy, then {install}")
    if not installed(name):
        raise PipelineNotInstalled(f"spaCy pipeline {name!r} is not installed; install it with: {install}")


def check_reward_pipeline(reward: Any, given: str) -> None:
    """For a reward that parses stories with spaCy unless its text units come
    with the stories: raise :class:`storyrl.rewards.base.RewardError` when the
    reward's ``spacy_pipeline`` is missing and ``reward.text_units_given`` is
    false. ``given`` says how to pass the units instead."""
    if getattr(reward, "text_units_given", False) or getattr(reward, "_extractor", None) is not None:
        return
    try:
        require_pipeline(reward.spacy_pipeline)
    except PipelineNotInstalled as exc:
        from storyrl.rewards.base import RewardError

        raise RewardError(f"reward {reward.name!r}: {exc} (or give {given})") from None


def _check_units(units: str) -> None:
    if units not in UNITS:
        raise ValueError(f"units must be one of {UNITS}, got {units!r}")


def sentence_phrases(doc, units: str = "noun_phrases") -> list[str]:
    """Lower-cased phrases of one parsed sentence, repeats dropped (order kept)."""
    _check_units(units)
    if units == "noun_phrases":
        items = (chunk.text.lower() for chunk in doc.noun_chunks)
    else:
        items = (tok.text.lower() for tok in doc if tok.pos_ in ("NOUN", "PROPN"))
    return list(dict.fromkeys(items))


def load_pronouns(path: str | os.PathLike | None = None) -> frozenset[str]:
    """GROOViST's pronoun list: one entry per line, stripped (blank lines ignored)."""
    resolved = asset_path("all_pronouns.txt", path)
    with open(resolved, encoding="utf-8-sig") as fh:
        return frozenset(s for s in (line.strip() for line in fh) if s)


def scoring_phrases(phrases: Iterable[str], pronouns: Iterable[str]) -> list[str]:
    """The phrases GROOViST scores: story-level repeats and pronouns removed, order kept."""
    pronouns = pronouns if isinstance(pronouns, (set, frozenset)) else frozenset(pronouns)
    return [p for p in dict.fromkeys(phrases) if p not in pronouns]


class PhraseExtractor:
    """Per-story phrase lists, as the authors' ``extract_nphrases.py`` writes them.

    ``nlp``: any object with a spaCy-like ``pipe(texts, batch_size=...)``
    yielding parsed docs (tests pass a fake); by default the ``pipeline`` is
    loaded with :func:`load_pipeline` on first use. Parsed sentences are cached
    (placeholder-replaced text -> phrases), at most ``cache_size`` of them,
    least recently used dropped first.

    Pickling (e.g. to reward worker processes) drops the loaded pipeline and the
    cache; the copy loads ``pipeline`` by name when first used, also when an
    ``nlp`` object was passed in.
    """

    def __init__(
        self,
        pipeline: str = DEFAULT_PIPELINE,
        units: str = "noun_phrases",
        batch_size: int = 64,
        nlp=None,
        cache_size: int = 100_000,
    ) -> None:
        _check_units(units)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size!r}")
        self.pipeline = pipeline
        self.units = units
        self.batch_size = batch_size
        self.cache_size = cache_size
        self._nlp = nlp
        self._cache = LruDict(cache_size)

    @property
    def nlp(self):
        if self._nlp is None:
            self._nlp = load_pipeline(self.pipeline)
        return self._nlp

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_nlp"] = None
        state["_cache"] = LruDict(self.cache_size)
        return state

    def clear_cache(self) -> None:
        self._cache.clear()

    def extract(self, stories: Sequence[str]) -> list[list[str]]:
        """Raw phrase list of each story (in-sentence repeats dropped, repeats
        across sentences kept, pronouns kept), in the order of ``stories``."""
        if isinstance(stories, str):
            raise TypeError("extract() takes a list of stories, not a single string")
        per_story = [[replace_placeholders(s) for s in split_sentences(story)] for story in stories]
        cache = self._cache
        # One pipe over every distinct sentence not seen before: the parser is
        # far faster on batches than on single sentences.
        todo = list(dict.fromkeys(s for sents in per_story for s in sents if s not in cache))
        parsed: dict[str, tuple[str, ...]] = {}
        if todo:
            docs = self.nlp.pipe(todo, batch_size=self.batch_size)
            for text, doc in zip(todo, docs, strict=True):
                parsed[text] = tuple(sentence_phrases(doc, self.units))
        result = []
        for sents in per_story:
            phrases: list[str] = []
            for sent in sents:
                found = parsed.get(sent)
                phrases.extend(found if found is not None else cache.get_fresh(sent))
            result.append(phrases)
        self._remember(parsed)
        return result

    def _remember(self, parsed: dict[str, tuple[str, ...]]) -> None:
        for sentence, phrases in parsed.items():
            self._cache.put(sentence, phrases)
