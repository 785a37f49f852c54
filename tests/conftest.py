"""Shared fixtures. The authors' data lives in ../shared/data (never copied
here): tests that need it skip with a reason when it is absent, and fail
instead when STORYRL_REQUIRE_SHARED=1 (CI). Tiny random-weight models,
tokenizers and their files are built by tiny_models.py; the common ones are
fixtures here."""

from __future__ import annotations

import contextlib

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("STORYRL_SHARED_DATA", REPO.parent / "shared" / "data"))

sys.path.insert(0, str(Path(__file__).parent))  # for nltk_reference and tiny_models

import tiny_models  # noqa: E402


def shared_path(*parts: str) -> Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        if os.environ.get("STORYRL_REQUIRE_SHARED") == "1":
            pytest.fail(f"STORYRL_REQUIRE_SHARED=1 but {path} is missing")
        pytest.skip(f"shared reference data not available: {path}")
    return path


def load_story_json(*parts: str) -> dict[str, str]:
    return json.loads(shared_path(*parts).read_text(encoding="utf-8"))


# -- reduced precision against fp32 ---------------------------------------------

#: Machine epsilon of each reduced precision (2^-10 for fp16's 10-bit mantissa,
#: 2^-7 for bf16's 7-bit one).
EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7}
#: Allowed error in units of EPS x the score's scale: every layer of the tiny
#: models rounds its activations to the dtype (relative error <= EPS/2 each)
#: and these errors compound through their 2 to 4 layers, grown by the
#: weights' gain (the contract's Vrank BERT has weights of std 0.5, 25x
#: BERT's, to spread its scores). Measured on the CPU: at most 7.4 EPS
#: (vrank, fp16), 3.1 (groovist, bf16), under 1 for the others.
ULPS = 16


def precision_tolerance(precision: str, fp32_scores) -> float:
    """Absolute tolerance of a reduced-precision run against fp32: ``ULPS``
    units of the dtype's roundoff times the scores' scale (at least 1)."""
    import numpy as np

    fp32_scores = np.asarray(fp32_scores, dtype=float)
    finite = fp32_scores[np.isfinite(fp32_scores)]
    return ULPS * EPS[precision] * max(1.0, float(np.abs(finite).max(initial=0.0)))


# -- tiny random-weight models and their files (built in tiny_models.py) --------


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """A tiny random-weight CLIP as an open_clip ``local-dir:`` model name."""
    return tiny_models.save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """Paths of 3 small distinct test images, ``img0.png`` to ``img2.png`` in one folder."""
    return [str(p) for p in tiny_models.write_images(tmp_path_factory.mktemp("img"), n=3)]


@pytest.fixture(scope="session")
def glove_path(tmp_path_factory) -> str:
    """A GloVe file: ``tiny_models.GLOVE_WORDS`` with random ``WORD_DIM``-d vectors."""
    return tiny_models.write_glove(tmp_path_factory.mktemp("glove") / "glove.txt")


@pytest.fixture(scope="session")
def rovist_vg_dir(tmp_path_factory) -> str:
    """A tiny random-weight RoViST-VG model saved in storyrl's format (for
    ``WORD_DIM``-d word vectors, as ``glove_path``)."""
    directory = tmp_path_factory.mktemp("rovist_vg_model")
    tiny_models.rovist_vg_model().save_pretrained(directory)
    return str(directory)


@contextlib.contextmanager
def _torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """Tiny models: thread start-up and contention on a shared 2-core machine
    cost far more than they save (epochs went from 0.08 s to 10 s)."""
    with _torch_threads(1):
        yield


@pytest.fixture
def trl_offline(monkeypatch):
    """TRL trainers on tiny models: one thread (``one_thread``), no hub
    calls, no wandb (``pytestmark = pytest.mark.usefixtures("trl_offline")``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    with _torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """``one_thread`` for a whole module (``pytestmark =
    pytest.mark.usefixtures("one_thread_module")``)."""
    with _torch_threads(1):
        yield
