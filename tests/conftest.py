"""Shared fixtures. The authors' data lives in ../shared/data (never copied
here): tests that need it skip with a reason when it is absent, and fail
instead when STORYRL_REQUIRE_SHARED=1 (CI)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("STORYRL_SHARED_DATA", REPO.parent / "shared" / "data"))

sys.path.insert(0, str(Path(__file__).parent))  # for nltk_reference


def shared_path(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        if os.environ.get("STORYRL_REQUIRE_SHARED") == "1":
            pytest.fail(f"STORYRL_REQUIRE_SHARED=1 but {path} is missing")
        pytest.skip(f"shared reference data not available: {path}")
    return path


def load_story_json(*parts: str) -> dict[str, str]:
    return json.loads(shared_path(*parts).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """A tiny random-weight CLIP as an open_clip ``local-dir:`` model name."""
    from clip_fixtures import make_tiny_clip

    return make_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Paths of 3 small distinct test images."""
    from clip_fixtures import make_images

    return [str(p) for p in make_images(tmp_path_factory.mktemp("img"), n=3)]


@pytest.fixture
def one_thread():
    """Tiny models: thread start-up and contention on a shared 2-core machine
    cost far more than they save (epochs went from 0.08 s to 10 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
