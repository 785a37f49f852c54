"""Asset cache: where it is, how missing files are reported, and downloads
(with a fake opener: no network)."""

from __future__ import annotations

import io
import urllib.error
from pathlib import Path

import pytest

from storyrl.assets import ASSETS, Asset, asset_path, cache_dir, download_assets


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("STORYRL_CACHE", str(folder))
    return folder


class FakeOpener:
    """Stands in for urlopen: serves bytes per URL and records requests."""

    def __init__(self, contents=None, error=None):
        self.contents = contents or {a.url: f"data of {a.name}\n".encode() for a in ASSETS.values()}
        self.error = error
        self.requests = []

    def __call__(self, url, timeout=None):
        self.requests.append((url, timeout))
        if self.error is not None:
            raise self.error
        return io.BytesIO(self.contents[url])


class BrokenStream(io.BytesIO):
    """A response that fails after the first chunk (connection reset)."""

    def read(self, size=-1):
        if self.tell() > 0:
            raise ConnectionResetError("connection reset by peer")
        return super().read(4)


# ------------------------------------------------------------------ cache_dir


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("STORYRL_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("STORYRL_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "storyrl"
    monkeypatch.setenv("STORYRL_CACHE", "")  # empty counts as unset
    assert cache_dir() == tmp_path / "xdg" / "storyrl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "storyrl"


def test_cache_dir_expands_user(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("STORYRL_CACHE", "~/c")
    assert cache_dir() == tmp_path / "c"


def test_assets_table():
    assert set(ASSETS) == {"concreteness_ratings.csv", "all_pronouns.txt"}
    for name, asset in ASSETS.items():
        assert isinstance(asset, Asset) and asset.name == name and asset.description
        assert asset.url == f"https://raw.githubusercontent.com/akskuchi/groovist/main/data/{name}"
    with pytest.raises(AttributeError):
        ASSETS["all_pronouns.txt"].url = "x"  # frozen


# ------------------------------------------------------------------ asset_path


def test_asset_path_explicit(tmp_path, cache):
    path = tmp_path / "mine.txt"
    path.write_text("he\n")
    assert asset_path("all_pronouns.txt", path) == path
    assert asset_path("all_pronouns.txt", str(path)) == path
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        asset_path("all_pronouns.txt", missing)


def test_asset_path_cache(cache):
    with pytest.raises(FileNotFoundError) as info:
        asset_path("all_pronouns.txt")
    message = str(info.value)
    assert str(cache / "all_pronouns.txt") in message
    assert "storyrl assets" in message and "internet" in message
    assert "path" in message
    cache.mkdir()
    (cache / "all_pronouns.txt").write_text("he\n")
    assert asset_path("all_pronouns.txt") == cache / "all_pronouns.txt"


# ------------------------------------------------------------------ downloads


def test_download_all_into_cache(cache):
    opener = FakeOpener()
    paths = download_assets(opener=opener)
    assert paths == [cache / name for name in ASSETS]
    for name, path in zip(ASSETS, paths):
        assert path.read_bytes() == f"data of {name}\n".encode()
    assert [url for url, _ in opener.requests] == [a.url for a in ASSETS.values()]
    assert sorted(p.name for p in cache.iterdir()) == sorted(ASSETS)  # no temporary files left


def test_download_selected_into_dest(tmp_path, cache):
    dest = tmp_path / "elsewhere" / "deep"
    paths = download_assets(["all_pronouns.txt"], dest=dest, opener=FakeOpener())
    assert paths == [dest / "all_pronouns.txt"]
    assert not cache.exists()


def test_download_skips_existing_unless_forced(cache):
    cache.mkdir()
    existing = cache / "all_pronouns.txt"
    existing.write_text("kept\n")
    opener = FakeOpener()
    download_assets(opener=opener)
    assert existing.read_text() == "kept\n"
    assert [url for url, _ in opener.requests] == [ASSETS["concreteness_ratings.csv"].url]
    download_assets(["all_pronouns.txt"], force=True, opener=opener)
    assert existing.read_text() == "data of all_pronouns.txt\n"


def test_download_error_names_asset_and_url(cache):
    opener = FakeOpener(error=urllib.error.URLError("no route to host"))
    with pytest.raises(RuntimeError) as info:
        download_assets(["concreteness_ratings.csv"], opener=opener)
    message = str(info.value)
    assert "concreteness_ratings.csv" in message
    assert ASSETS["concreteness_ratings.csv"].url in message
    assert list(cache.iterdir()) == []  # nothing written


def test_failed_download_leaves_no_partial_file(cache):
    def opener(url, timeout=None):
        return BrokenStream(b"x" * 100)

    with pytest.raises(RuntimeError, match="connection reset"):
        download_assets(["all_pronouns.txt"], opener=opener)
    assert list(cache.iterdir()) == []
    # an existing file survives a failed forced re-download
    (cache / "all_pronouns.txt").write_text("old\n")
    with pytest.raises(RuntimeError):
        download_assets(["all_pronouns.txt"], force=True, opener=opener)
    assert [p.name for p in cache.iterdir()] == ["all_pronouns.txt"]
    assert (cache / "all_pronouns.txt").read_text() == "old\n"


def test_empty_response_is_an_error(cache):
    opener = FakeOpener({ASSETS["all_pronouns.txt"].url: b""})
    with pytest.raises(RuntimeError, match="empty"):
        download_assets(["all_pronouns.txt"], opener=opener)
    assert list(cache.iterdir()) == []


def test_unknown_asset(cache):
    with pytest.raises(KeyError, match="nope"):
        download_assets(["nope"], opener=FakeOpener())


def test_downloaded_files_are_found(cache):
    download_assets(opener=FakeOpener())
    assert asset_path("concreteness_ratings.csv") == Path(cache) / "concreteness_ratings.csv"
