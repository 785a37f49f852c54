"""GloVe word vectors: the text side of the RoViST-VG model
(:mod:`storyrl.models.rovist_vg`) embeds a noun as the mean GloVe vector of
its words. :func:`load_glove` reads GloVe's text format; :func:`shared_glove`
keeps one table per file and process. Light to import (no torch).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from storyrl.models.runtime import shared_model

__all__ = ["GloVe", "load_glove", "shared_glove"]


class GloVe:
    """Word vectors: ``vectors[index[word]]``. Words are looked up lower-cased
    (GloVe 6B/42B are lower-case; a cased file only answers for its
    lower-case entries)."""

    def __init__(self, words: Sequence[str], vectors: np.ndarray, path: str | None = None) -> None:
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(words):
            raise ValueError(f"{len(words)} words but vectors of shape {vectors.shape}")
        self.index = {w: i for i, w in enumerate(words)}
        self.vectors = vectors
        self.path = path
        self.cache_key: Any = None  # set for shared (whole-file) tables

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, word: str) -> bool:
        return word.lower() in self.index

    def vector(self, word: str) -> np.ndarray | None:
        row = self.index.get(word.lower())
        return None if row is None else self.vectors[row]

    def phrase_vector(self, phrase: str) -> np.ndarray | None:
        """Mean vector of the phrase's whitespace-separated words that have
        one (the authors average multi-word mentions); None when none has."""
        rows = [self.index.get(w) for w in phrase.lower().split()]
        rows = [r for r in rows if r is not None]
        if not rows:
            return None
        return self.vectors[rows].mean(axis=0)

    def __repr__(self) -> str:
        return f"GloVe({len(self)} words, dim={self.dim}, path={self.path!r})"


def load_glove(path: str | os.PathLike, vocabulary: Collection[str] | None = None, dim: int | None = None) -> GloVe:
    """Read GloVe's text format: per line a word then its numbers, separated
    by single spaces. ``vocabulary`` keeps only those words (compared as
    written; lower-case words for GloVe 6B), to save memory. ``dim`` defaults
    to the first line's number of values; words containing spaces (as in
    glove.840B) are the leading fields beyond ``dim``. A word2vec-style header
    line ``<count> <dim>`` is accepted. Repeated words: the first one wins.
    Errors (ValueError) name the file and line; lines dropped by
    ``vocabulary`` are not checked.
    """
    path = str(path)
    words: list[str] = []
    rows: list[np.ndarray] = []
    seen: set[str] = set()
    lineno = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                line = line.rstrip("\r\n").rstrip(" ")
                if not line.strip():
                    continue
                parts = line.split(" ")
                if dim is None:
                    if lineno == 1 and len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                        dim = int(parts[1])  # word2vec text header
                        continue
                    dim = len(parts) - 1
                    if dim < 1:
                        raise ValueError(
                            f"{path}, line {lineno}: expected a word followed by numbers, got {line[:80]!r}"
                        )
                if len(parts) < dim + 1:
                    raise ValueError(
                        f"{path}, line {lineno}: expected a word and {dim} numbers, found {len(parts)} fields"
                    )
                word = parts[0] if len(parts) == dim + 1 else " ".join(parts[: len(parts) - dim])
                if (vocabulary is not None and word not in vocabulary) or word in seen:
                    continue
                try:
                    vec = np.asarray(parts[len(parts) - dim :], dtype=np.float32)
                except ValueError:
                    bad = next(p for p in parts[len(parts) - dim :] if not _is_number(p))
                    raise ValueError(f"{path}, line {lineno}: {bad[:40]!r} is not a number (word {word!r})") from None
                if not np.isfinite(vec).all():
                    raise ValueError(f"{path}, line {lineno}: non-finite value in the vector of {word!r}")
                seen.add(word)
                words.append(word)
                rows.append(vec)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}, line {lineno + 1}: not valid UTF-8 ({exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read GloVe vectors: {exc.strerror or exc}") from exc
    if dim is None:
        raise ValueError(f"{path}: no word vectors in the file")
    vectors = np.stack(rows) if rows else np.zeros((0, dim), np.float32)
    return GloVe(words, vectors, path)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def shared_glove(path: str | os.PathLike) -> GloVe:
    """The whole GloVe file, read once per process (and again if it changes)."""
    resolved = os.path.abspath(path)
    try:
        st = os.stat(resolved)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read GloVe vectors: {exc.strerror or exc}") from exc
    key = ("glove", resolved, st.st_size, st.st_mtime_ns)

    def load() -> GloVe:
        glove = load_glove(resolved)
        glove.cache_key = key  # noun embeddings are cached per file version
        return glove

    return shared_model(key, load)
