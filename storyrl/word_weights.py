"""Per-phrase weights for grounding metrics (GROOViST and its ablations).

Three weightings share ``weights(phrases) -> list[float]``:

* :class:`Concreteness` -- GROOViST's weight: the mean Brysbaert et al. (2014)
  concreteness rating of the phrase's words, each word looked up as written or,
  failing that, via its noun lemma; 1.0 when no word is rated.
* :class:`Idf` -- mean inverse document frequency over a story corpus (the
  paper's "-C +idf" ablation; also RoViST-VG's weighting).
* :class:`NoWeights` -- 1.0 for every phrase (the "-C" ablation).

Lemmas without WordNet
----------------------
GROOViST lemmatizes with NLTK's ``WordNetLemmatizer().lemmatize(word)`` (noun
part of speech, WordNet's *morphy*). WordNet data cannot be downloaded here, so
:func:`lemmatize_noun` runs the same morphy procedure (exception table first,
otherwise the noun suffix rules, applied again until something matches, shortest
match wins) but decides which candidate forms are valid by looking them up in a
vocabulary -- the ratings' own keys -- instead of WordNet's noun lexicon. What
that changes:

* A candidate that is a rated word but not a WordNet noun is accepted, so some
  words NLTK leaves unrated get a rating here (e.g. "happens" -> "happen", a
  verb), which changes that phrase's weight.
* A candidate that WordNet knows but the ratings lack is rejected, so where
  NLTK would stop at an unrated lemma we may go on to a rated one (or where
  NLTK picks the shorter unrated of two WordNet lemmas, we pick the rated one).
* The exception table is a few dozen common irregular plurals, not WordNet's
  ~2,000-entry ``noun.exc``; rarer irregular plurals stay unrated.

Only words that are not themselves keys of the ratings reach the lemmatizer,
and on story text these are mostly regular plurals, where both agree.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from storyrl.assets import asset_path
from storyrl.text import word_tokenize

__all__ = [
    "IRREGULAR_NOUNS",
    "NOUN_SUFFIX_RULES",
    "Concreteness",
    "Idf",
    "NoWeights",
    "PhraseWeights",
    "lemmatize_noun",
    "load_concreteness",
]

_PHRASE_CACHE_SIZE = 200_000  # phrases remembered per weighting object


class PhraseWeights(Protocol):
    def weight(self, phrase: str) -> float: ...

    def weights(self, phrases: Iterable[str]) -> list[float]: ...


# ---------------------------------------------------------------------------
# Concreteness ratings file
# ---------------------------------------------------------------------------


def load_concreteness(path: str | os.PathLike | None = None) -> dict[str, float]:
    """Ratings ``{word: Conc.M}`` from GROOViST's ``Word;Conc.M`` CSV or
    Brysbaert's original tab-separated txt (detected from the header).

    Keys are kept exactly as written (GROOViST matches words case-sensitively).
    ``path=None`` reads the cached asset. The parse is cached per file (and its
    modification time), since the file has ~40k lines; a fresh dict is returned.
    """
    resolved = asset_path("concreteness_ratings.csv", path).resolve()
    stat = resolved.stat()
    return dict(_parse_ratings(str(resolved), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=8)
def _parse_ratings(path: str, mtime_ns: int, size: int) -> dict[str, float]:
    del mtime_ns, size  # only part of the cache key
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # GROOViST's copy starts with a BOM
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not valid UTF-8 ({exc.reason})") from None
    # The reference reads with universal newlines (the file has CRLF endings).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    header = lines[0].strip()
    if ";" in header:
        sep = ";"
    elif "\t" in header:
        sep = "\t"
    else:
        raise ValueError(
            f"{path}, line 1: unrecognised header {header!r}; expected 'Word;Conc.M' "
            "or Brysbaert's tab-separated columns"
        )
    columns = [c.strip() for c in header.split(sep)]
    if "Word" not in columns or "Conc.M" not in columns:
        raise ValueError(f"{path}, line 1: header {header!r} has no 'Word' and 'Conc.M' columns")
    word_col, rating_col = columns.index("Word"), columns.index("Conc.M")
    needed = max(word_col, rating_col) + 1
    ratings: dict[str, float] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # trailing newline / blank line
        # GROOViST strips the whole line before splitting; tab-separated rows are
        # only split, since stripping could drop an empty leading column.
        fields = line.strip().split(sep) if sep == ";" else line.split(sep)
        if len(fields) < needed:
            raise ValueError(
                f"{path}, line {lineno}: expected at least {needed} {sep!r}-separated fields, "
                f"found {len(fields)}: {line!r}"
            )
        word, value = fields[word_col], fields[rating_col]
        if not word:
            raise ValueError(f"{path}, line {lineno}: empty word: {line!r}")
        try:
            rating = float(value)
        except ValueError:
            raise ValueError(f"{path}, line {lineno}: rating {value!r} is not a number") from None
        if not math.isfinite(rating):
            raise ValueError(f"{path}, line {lineno}: rating {value!r} is not finite")
        ratings[word] = rating  # a repeated word: the last one wins, as in GROOViST
    return ratings


# ---------------------------------------------------------------------------
# Noun lemmas (WordNet morphy, validated against a vocabulary)
# ---------------------------------------------------------------------------

#: Irregular plural -> lemma candidates: the part of WordNet's noun exception
#: list that story text is likely to need.
IRREGULAR_NOUNS: dict[str, tuple[str, ...]] = {
    "children": ("child",),
    "men": ("man",),
    "women": ("woman",),
    "people": ("person",),
    "feet": ("foot",),
    "teeth": ("tooth",),
    "geese": ("goose",),
    "mice": ("mouse",),
    "lice": ("louse",),
    "oxen": ("ox",),
    "brethren": ("brother",),
    "pence": ("penny",),
    "dice": ("die",),
    "leaves": ("leaf", "leave"),
    "wives": ("wife",),
    "knives": ("knife",),
    "lives": ("life",),
    "wolves": ("wolf",),
    "halves": ("half",),
    "shelves": ("shelf",),
    "loaves": ("loaf",),
    "thieves": ("thief",),
    "calves": ("calf",),
    "elves": ("elf",),
    "selves": ("self",),
    "sheaves": ("sheaf",),
    "scarves": ("scarf",),
    "wharves": ("wharf",),
    "hooves": ("hoof",),
    "dwarves": ("dwarf",),
    "heroes": ("hero",),
    "potatoes": ("potato",),
    "tomatoes": ("tomato",),
    "echoes": ("echo",),
    "vetoes": ("veto",),
    "torpedoes": ("torpedo",),
    "criteria": ("criterion",),
    "phenomena": ("phenomenon",),
    "cacti": ("cactus",),
    "fungi": ("fungus",),
    "nuclei": ("nucleus",),
    "radii": ("radius",),
    "stimuli": ("stimulus",),
    "alumni": ("alumnus",),
    "bacteria": ("bacterium",),
    "data": ("datum",),
    "media": ("medium",),
    "curricula": ("curriculum",),
    "memoranda": ("memorandum",),
    "strata": ("stratum",),
    "larvae": ("larva",),
    "vertebrae": ("vertebra",),
    "antennae": ("antenna",),
    "formulae": ("formula",),
    "indices": ("index",),
    "appendices": ("appendix",),
    "matrices": ("matrix",),
    "vertices": ("vertex",),
    "axes": ("ax", "axis", "axe"),
    "crises": ("crisis",),
    "analyses": ("analysis",),
    "theses": ("thesis",),
    "hypotheses": ("hypothesis",),
    "bases": ("base", "basis"),
    "diagnoses": ("diagnosis",),
    "oases": ("oasis",),
    "parentheses": ("parenthesis",),
    "ellipses": ("ellipse", "ellipsis"),
    "synopses": ("synopsis",),
    "emphases": ("emphasis",),
    "passersby": ("passerby",),
}

#: Morphy's noun suffix substitutions, in NLTK's order (NLTK adds "ves" -> "f"
#: to WordNet's eight rules).
NOUN_SUFFIX_RULES: tuple[tuple[str, str], ...] = (
    ("s", ""),
    ("ses", "s"),
    ("ves", "f"),
    ("xes", "x"),
    ("zes", "z"),
    ("ches", "ch"),
    ("shes", "sh"),
    ("men", "man"),
    ("ies", "y"),
)


def _apply_rules(forms: list[str]) -> list[str]:
    out = []
    for form in forms:
        for old, new in NOUN_SUFFIX_RULES:
            if form.endswith(old):
                out.append(form[: -len(old)] + new)
    return list(dict.fromkeys(out))  # repeats would only repeat work


def _known(forms: Iterable[str], vocabulary: Collection[str]) -> list[str]:
    return [f for f in dict.fromkeys(forms) if f in vocabulary]


def lemmatize_noun(word: str, vocabulary: Collection[str]) -> str | None:
    """The noun lemma of ``word`` that is in ``vocabulary``, or None.

    Stand-in for NLTK's ``WordNetLemmatizer().lemmatize(word)`` with
    ``vocabulary`` in place of WordNet (see the module docstring): an irregular
    plural is resolved from :data:`IRREGULAR_NOUNS` only; otherwise the word and
    one round of :data:`NOUN_SUFFIX_RULES` are tried, then further rounds until a
    form is found. Of the forms found the shortest wins (ties: the first).
    NLTK returns the word itself when nothing is found; this returns None.
    """
    if word in IRREGULAR_NOUNS:
        found = _known((word, *IRREGULAR_NOUNS[word]), vocabulary)
    else:
        forms = _apply_rules([word])
        found = _known([word, *forms], vocabulary)
        while not found and forms:
            forms = _apply_rules(forms)
            found = _known(forms, vocabulary)
    return min(found, key=len) if found else None


# ---------------------------------------------------------------------------
# Weightings
# ---------------------------------------------------------------------------


class _CachedWeights:
    """Per-phrase memo shared by the weightings (RL scores the same phrases often)."""

    def __init__(self) -> None:
        self._cache: dict[str, float] = {}

    def _compute(self, phrase: str) -> float:
        raise NotImplementedError

    def weight(self, phrase: str) -> float:
        value = self._cache.get(phrase)
        if value is None:
            if len(self._cache) >= _PHRASE_CACHE_SIZE:
                self._cache.clear()
            value = self._cache[phrase] = self._compute(phrase)
        return value

    def weights(self, phrases: Iterable[str]) -> list[float]:
        return [self.weight(p) for p in phrases]


class Concreteness(_CachedWeights):
    """GROOViST's concreteness weight of a noun phrase.

    Words are ``phrase.strip().split(' ')``; each counts with its rating if it is
    a key of the ratings, else with the rating of its noun lemma
    (:func:`lemmatize_noun`) if that is found. Weight = mean of the counted
    ratings (summed left to right, as the reference does), 1.0 if none.
    """

    def __init__(self, ratings: Mapping[str, float]) -> None:
        super().__init__()
        self.ratings = ratings

    @classmethod
    def from_path(cls, path: str | os.PathLike | None = None) -> Concreteness:
        return cls(load_concreteness(path))

    def _compute(self, phrase: str) -> float:
        ratings = self.ratings
        total, count = 0.0, 0
        for word in phrase.strip().split(" "):
            rating = ratings.get(word)
            if rating is None:
                lemma = lemmatize_noun(word, ratings)
                if lemma is None:
                    continue
                rating = ratings[lemma]
            total += rating
            count += 1
        return total / count if count else 1.0


class Idf(_CachedWeights):
    """Inverse document frequency over a story corpus.

    ``idf(w) = log(N / (1 + df(w)))`` with N stories and df(w) the number of
    stories containing the (lower-cased) word token w; an unseen word has df 0.
    Note that a word in every story gets a slightly negative idf. A phrase's
    weight is the mean idf of its lower-cased space-separated words (empty words
    from repeated spaces are skipped; a phrase without words weighs 0.0).
    """

    def __init__(self, n_docs: int, df: Mapping[str, int]) -> None:
        super().__init__()
        if isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1:
            raise ValueError(f"n_docs must be a positive integer, got {n_docs!r}")
        self.n_docs = n_docs
        self.df = dict(df)

    @classmethod
    def from_counts(cls, n_docs: int, df: Mapping[str, int]) -> Idf:
        return cls(n_docs, df)

    @classmethod
    def from_stories(cls, stories: Iterable[str]) -> Idf:
        """Count document frequencies with the project's NLTK-compatible tokenizer."""
        df: dict[str, int] = {}
        n_docs = 0
        for story in stories:
            n_docs += 1
            # Lower-case tokens, not the text: capitals steer sentence splitting.
            for token in {t.lower() for t in word_tokenize(story)}:
                df[token] = df.get(token, 0) + 1
        if not n_docs:
            raise ValueError("Idf.from_stories needs at least one story")
        return cls(n_docs, df)

    def idf(self, word: str) -> float:
        return math.log(self.n_docs / (1 + self.df.get(word, 0)))

    def _compute(self, phrase: str) -> float:
        words = [w for w in phrase.strip().lower().split(" ") if w]
        if not words:
            return 0.0
        total = 0.0
        for word in words:
            total += self.idf(word)
        return total / len(words)

    def to_json(self, path: str | os.PathLike) -> None:
        """Save the counts, so a corpus is tokenized once."""
        data = {"n_docs": self.n_docs, "df": self.df}
        Path(path).write_text(json.dumps(data, ensure_ascii=False, sort_keys=True), encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Idf:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        try:
            n_docs, df = data["n_docs"], data["df"]
        except (TypeError, KeyError):
            raise ValueError(f"{path}: expected a JSON object with 'n_docs' and 'df'") from None
        if not isinstance(df, dict) or not all(isinstance(v, int) and v >= 0 for v in df.values()):
            raise ValueError(f"{path}: 'df' must map words to non-negative integers")
        return cls(n_docs, df)


class NoWeights:
    """Every phrase weighs 1.0 (the "-C" ablation: no concreteness)."""

    def weight(self, phrase: str) -> float:
        return 1.0

    def weights(self, phrases: Iterable[str]) -> list[float]:
        return [1.0 for _ in phrases]


def load_idf(path: str | os.PathLike) -> Idf:
    """Idf weights from a saved table (:meth:`Idf.to_json`) or a story set
    (JSON ``{id: story}`` / JSONL), counted on the fly."""
    import json

    from storyrl.data import load_stories

    try:
        with open(path, encoding="utf-8") as fh:
            head = json.load(fh)
        if isinstance(head, dict) and "df" in head and "n_docs" in head:
            return Idf.from_json(path)
    except (OSError, ValueError):
        pass
    return Idf.from_stories(r.story for r in load_stories(path))
