"""Data files the metrics need but the project cannot ship.

The concreteness ratings and the pronoun list come with the GROOViST release
(under its licence, not ours), so they live in a per-user cache filled by
``storyrl assets`` (:func:`download_assets`) on a machine with internet access.
Everything that reads them goes through :func:`asset_path`, which also accepts
an explicit path, so offline machines can point at a copy made elsewhere.

The cache folder is ``$STORYRL_CACHE`` if set, else ``$XDG_CACHE_HOME/storyrl``,
else ``~/.cache/storyrl``.
"""

from __future__ import annotations

import http.client
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ASSETS", "Asset", "asset_path", "cache_dir", "download_assets"]


@dataclass(frozen=True)
class Asset:
    """A file fetched into the cache: its file name, where it comes from, what it is."""

    name: str
    url: str
    description: str


_GROOVIST_DATA = "https://raw.githubusercontent.com/akskuchi/groovist/main/data"

ASSETS: dict[str, Asset] = {
    asset.name: asset
    for asset in (
        Asset(
            "concreteness_ratings.csv",
            f"{_GROOVIST_DATA}/concreteness_ratings.csv",
            "Brysbaert et al. (2014) concreteness ratings (1-5) of ~40k English lemmas, "
            "as distributed with GROOViST (`Word;Conc.M`)",
        ),
        Asset(
            "all_pronouns.txt",
            f"{_GROOVIST_DATA}/all_pronouns.txt",
            "pronoun list GROOViST removes from a story's noun phrases (one per line)",
        ),
    )
}


def cache_dir() -> Path:
    """Folder of the cached assets (not created here)."""
    for var, sub in (("STORYRL_CACHE", None), ("XDG_CACHE_HOME", "storyrl")):
        value = os.environ.get(var)
        if value:  # an empty variable means "unset", as for XDG
            root = Path(value).expanduser()
            return root / sub if sub else root
    return Path.home() / ".cache" / "storyrl"


def asset_path(name: str, path: str | os.PathLike | None = None) -> Path:
    """Where to read asset ``name`` from: ``path`` when given, else the cache.

    Raises FileNotFoundError saying how to get the file when it is missing.
    """
    if path is not None:
        explicit = Path(path).expanduser()
        if not explicit.exists():
            raise FileNotFoundError(f"{name}: file not found: {explicit}")
        return explicit
    cached = cache_dir() / name
    if cached.exists():
        return cached
    asset = ASSETS.get(name)
    source = f" (source: {asset.url})" if asset else ""
    raise FileNotFoundError(
        f"{name} not found: looked for {cached}. Run `storyrl assets` on a machine with internet "
        f"access to download it into the cache (set STORYRL_CACHE to choose the folder), "
        f"or pass the file's path explicitly{source}."
    )


def download_assets(
    names: Iterable[str] | None = None,
    dest: str | os.PathLike | None = None,
    force: bool = False,
    opener: Callable = urllib.request.urlopen,
    timeout: float = 60.0,
) -> list[Path]:
    """Download assets (all of :data:`ASSETS` by default) into ``dest`` or the cache.

    Files already present are kept unless ``force``. Each file is written to a
    temporary file in ``dest`` and renamed into place, so an interrupted or
    failed download never leaves a truncated asset that would later be read as
    valid. ``opener(url, timeout=timeout)`` must return a context manager with
    ``read(n)`` (``urlopen``'s response; tests pass a fake). Returns the paths in
    the order of ``names``. Download failures raise RuntimeError naming the
    asset and its URL.
    """
    selected = list(ASSETS) if names is None else list(names)
    unknown = [n for n in selected if n not in ASSETS]
    if unknown:
        raise KeyError(f"unknown asset(s) {unknown}; known: {sorted(ASSETS)}")
    folder = Path(dest).expanduser() if dest is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in selected:
        asset = ASSETS[name]
        target = folder / name
        if target.exists() and not force:
            paths.append(target)
            continue
        _download(asset, target, opener, timeout)
        paths.append(target)
    return paths


def _download(asset: Asset, target: Path, opener: Callable, timeout: float) -> None:
    # Same folder as the target, so os.replace is an atomic rename.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{asset.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "wb") as out, opener(asset.url, timeout=timeout) as response:
                shutil.copyfileobj(response, out)
        except (OSError, http.client.HTTPException, ValueError) as exc:  # URLError is an OSError
            raise RuntimeError(f"could not download {asset.name} from {asset.url}: {exc}") from exc
        if tmp.stat().st_size == 0:
            raise RuntimeError(f"could not download {asset.name} from {asset.url}: empty response")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
