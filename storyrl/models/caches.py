"""Embedding caches of the model embedders: an in-memory LRU dict and an
on-disk (SQLite) cache of region embeddings. Light to import (no torch)."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: How region pixels are made: "exact" (PIL and the model's own transform, the
#: authors' scores) or "fast" (worker-process decoding, tensor preprocessing).
IMAGE_PIPELINES = ("exact", "fast")


def pipeline_key(pipeline: str) -> Callable[[Any], Hashable]:
    """The in-memory cache key of a region's vector made by ``pipeline``
    (ValueError for an unknown one): exact keeps the key regions always had,
    another pipeline's vectors get their own, so neither is served for the other."""
    if pipeline not in IMAGE_PIPELINES:
        raise ValueError(f"image pipeline must be one of {', '.join(IMAGE_PIPELINES)}, got {pipeline!r}")
    if pipeline == "exact":
        return lambda region: region.key
    return lambda region: (*region.key, pipeline)


class LruDict(OrderedDict):
    """A dict that forgets its least recently used entries beyond ``maxsize``."""

    def __init__(self, maxsize: int = 100_000) -> None:
        super().__init__()
        self.maxsize = maxsize

    def get_fresh(self, key: Hashable) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)

    def fetch(self, items: Mapping[Hashable, Any], encode: Callable[[list], Iterable],
              batch_size: int, *, batches: Callable[[list], Iterable[tuple[list, Iterable]]] | None = None,
              ) -> tuple[dict[Hashable, Any], int]:
        """The vector of every ``{key: item}``: cached ones from the cache,
        the others encoded ``batch_size`` items per ``encode(items)`` call
        (one vector per item) and cached under their keys; or, given
        ``batches(items)``, as the ``(items, vectors)`` pairs it yields (in
        any order: the fast image pipeline's, grouped by image). Returns
        ``({key: vector}, number encoded)``; the vectors are held here, so a
        request of more items than the cache keeps is whole (reading them
        back from the cache after filling it lost the first ones)."""
        found: dict[Hashable, Any] = {}
        todo = []
        for key, item in items.items():
            value = self.get_fresh(key)
            if value is None:
                todo.append((key, item))
            else:
                found[key] = value
        pending = [item for _, item in todo]
        if batches is None:
            chunks = (pending[start : start + batch_size] for start in range(0, len(pending), batch_size))
            produced = ((chunk, encode(chunk)) for chunk in chunks)
        else:
            produced = batches(pending)
        key_of = {id(item): key for key, item in todo}  # the producer hands back the items themselves
        for chunk, vecs in produced:
            for item, vec in zip(chunk, vecs):
                key = key_of[id(item)]
                self.put(key, vec)
                found[key] = vec
        return found, len(todo)


class DiskEmbeddingCache:
    """Region embeddings on disk (SQLite), keyed by model, image file and box.

    A file's key includes its size and modification time, so an edited image is
    re-embedded; in-memory (PIL) images are keyed by content hash. A
    ``variant`` (e.g. the fast image pipeline's ":fast") keeps vectors made
    another way apart from the default ones.
    """

    def __init__(self, directory: str | os.PathLike, model_key: str) -> None:
        self.path = Path(directory) / "embeddings.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.model_key = model_key
        #: The variant get_many/put_many use when given none (its owner sets it per call).
        self.variant = ""
        self._local = threading.local()
        with self._db() as db:
            db.execute("CREATE TABLE IF NOT EXISTS emb (key TEXT PRIMARY KEY, vec BLOB NOT NULL)")

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(self.path, timeout=60)
        return db

    def _key(self, region_key: Hashable, variant: str = "") -> str:
        source, box = region_key
        if isinstance(source, str) and not source.startswith("pil:"):
            try:
                st = os.stat(source)
                source = f"{os.path.abspath(source)}|{st.st_size}|{st.st_mtime_ns}"
            except OSError:
                pass
        # A variant (another image pipeline's vectors) extends the model key;
        # none keeps the keys caches were written with.
        raw = repr((self.model_key + variant, source, box)).encode()
        return hashlib.sha1(raw).hexdigest()

    def get_many(self, keys: Sequence[Hashable], variant: str | None = None) -> dict[Hashable, np.ndarray]:
        """The vectors stored for ``keys`` ((source, box) region keys) under
        ``variant`` (default :attr:`variant`)."""
        variant = self.variant if variant is None else variant
        found = {}
        db = self._db()
        for key in keys:
            row = db.execute("SELECT vec FROM emb WHERE key = ?", (self._key(key, variant),)).fetchone()
            if row is not None:
                found[key] = np.frombuffer(row[0], dtype=np.float32)
        return found

    def put_many(self, items: dict[Hashable, np.ndarray], variant: str | None = None) -> None:
        variant = self.variant if variant is None else variant
        with self._db() as db:
            db.executemany(
                "INSERT OR REPLACE INTO emb VALUES (?, ?)",
                [(self._key(k, variant), np.asarray(v, dtype=np.float32).tobytes()) for k, v in items.items()],
            )
