"""``storyrl doctor``: what a real run needs, whether it is here, and how to get it.

A run with the paper's setup needs pieces that storyrl cannot ship: GPU
torch, hub models (CLIP ViT-B/32 ``openai``, ``albert-large-v1``,
LLaVA-NeXT-7B), a spaCy pipeline, the GROOViST word lists (``storyrl
assets``), trained or released metric models, GloVe, and VIST. The pieces
are derived from the rewards' and configs' actual option values (a config
whose ``model:`` is a local directory needs that directory, not a hub id),
so the check follows the defaults when they change.

Checks are lookups only -- the Hugging Face cache, installed packages,
files -- and never load a model, so offline the doctor finishes in seconds.
The GPU is probed (:func:`gpu_facts`: each device's memory, compute
capability, bf16, an fp16 matmul, a bitsandbytes 4-bit round trip).
:func:`fetch` downloads what can be downloaded (hub snapshots, the spaCy
pipeline, the assets) and reports, per piece, what it could not.

By concern: :mod:`~storyrl.doctor.pieces` (Piece, Requirements),
:mod:`~storyrl.doctor.rewards` and :mod:`~storyrl.doctor.configs` (what
rewards and config files need), :mod:`~storyrl.doctor.checks` (lookups),
:mod:`~storyrl.doctor.gpu` (GPU facts and verdicts),
:mod:`~storyrl.doctor.fetching` (``--fetch``).
"""

from __future__ import annotations

from storyrl.doctor.checks import check
from storyrl.doctor.configs import config_requirements, paper_requirements, requirements
from storyrl.doctor.fetching import _FETCHERS, fetch  # noqa: F401 - _FETCHERS: the tests swap downloaders
from storyrl.doctor.gpu import GpuFacts, Line, gpu_facts, gpu_lines
from storyrl.doctor.pieces import (
    FETCHABLE,
    GLOVE_URL,
    KINDS,
    PAPER_DATA,
    PAPER_REWARDS,
    PYTORCH_INSTALL,
    REGIONS_URL,
    ROVIST_URL,
    VIST_URL,
    VWP_URL,
    Piece,
    Requirements,
)
from storyrl.doctor.rewards import reward_requirements

__all__ = [
    "FETCHABLE",
    "GLOVE_URL",
    "KINDS",
    "PAPER_DATA",
    "PAPER_REWARDS",
    "PYTORCH_INSTALL",
    "REGIONS_URL",
    "ROVIST_URL",
    "VIST_URL",
    "VWP_URL",
    "GpuFacts",
    "Line",
    "Piece",
    "Requirements",
    "check",
    "config_requirements",
    "fetch",
    "gpu_facts",
    "gpu_lines",
    "paper_requirements",
    "requirements",
    "reward_requirements",
]
