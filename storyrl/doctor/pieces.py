"""The doctor's vocabulary: :class:`Piece` (one thing a run needs),
:class:`Requirements` (the pieces, one per kind and target), and the
constructors and hints the reward and config walks share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storyrl.models.hub import looks_like_repo_id

PYTORCH_INSTALL = "https://pytorch.org/get-started/locally/"
# pip install -c constraints-cpu.txt would pin the CPU build again.
TORCH_HINT = f"a CUDA build of torch: {PYTORCH_INSTALL} (pip without -c constraints-cpu.txt)"
QUANT_HINT = 'pip install -e ".[quant]" (bitsandbytes; 4-bit needs a CUDA device)'
VIST_URL = "https://visionandlanguage.net/VIST/dataset.html"
VWP_URL = "https://vwprompt.github.io/"
GLOVE_URL = "https://nlp.stanford.edu/projects/glove/"
ROVIST_URL = "https://github.com/usydnlp/rovist"
REGIONS_URL = "https://github.com/akskuchi/groovist/blob/main/image_regions.md"

#: The d_HM paper's rewards: required when nothing is named, the others optional.
PAPER_REWARDS = ("dhm", "groovist", "coherence", "repetition")
#: Where the shipped configs (configs/sweeps/dhm_vist.yaml, configs/rl/) read VIST.
PAPER_DATA = "data/vist"

#: Kinds of piece; the first three can be downloaded by :func:`fetch`. A
#: "server" is a remote reward's server, asked ``GET /health``.
FETCHABLE = ("hub", "spacy", "asset")
KINDS = (*FETCHABLE, "torch", "path", "package", "server")

# How to get a file or directory option (a reward's, a generator's, a config's) when it is missing.
_OPTION_HINTS = {
    "region_table": REGIONS_URL,
    "crops_dir": REGIONS_URL,
    "image_root": VIST_URL,
    "idf_corpus": VIST_URL,
    "data": VIST_URL,
}


@dataclass
class Piece:
    """One thing a run needs: its ``kind`` (see :data:`KINDS`), ``target``
    (hub repo id, spaCy pipeline, asset file name, path, package, ``cuda``),
    what it is and the one command or link that gets it."""

    kind: str
    target: str
    label: str
    hint: str
    required: bool = True
    needed_by: list[str] = field(default_factory=list)
    present: bool | None = None  # None: not checked yet
    where: str = ""  # where it was found, or why it counts as missing
    fetch_error: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.target

    @property
    def fetchable(self) -> bool:
        return self.kind in FETCHABLE

    def to_json(self) -> dict[str, Any]:
        return {"piece": self.label, "kind": self.kind, "target": self.target, "required": self.required,
                "present": self.present, "where": self.where, "needed_by": list(self.needed_by),
                "get": None if self.present else self.hint, "fetchable": self.fetchable,
                "fetch_error": self.fetch_error}


class Requirements:
    """Pieces in the order they were first needed, one per (kind, target):
    required by anyone means required."""

    def __init__(self) -> None:
        self._pieces: dict[tuple[str, str], Piece] = {}

    def add(self, piece: Piece, owner: str) -> None:
        known = self._pieces.get(piece.key)
        if known is None:
            self._pieces[piece.key] = known = piece
        else:
            known.required = known.required or piece.required
        if owner not in known.needed_by:
            known.needed_by.append(owner)

    @property
    def pieces(self) -> list[Piece]:
        return list(self._pieces.values())

    def missing(self, required_only: bool = True) -> list[Piece]:
        return [p for p in self.pieces if not p.present and (p.required or not required_only)]



def _gpu_piece(required: bool) -> Piece:
    return Piece("torch", "cuda", "GPU torch (CUDA available)", TORCH_HINT, required)


def _server_piece(url: str, required: bool) -> Piece:
    """A remote reward's server (its ``url``: the base URL or the full
    ``/get_reward`` URL), checked by asking its ``/health``, as the reward's
    own setup does."""
    base = url.rstrip("/").removesuffix("/get_reward")
    return Piece("server", f"{base}/health", f"reward server {base}",
                 f"start `storyrl serve --config REWARD.yaml` at {base}, or fix the remote reward's url", required)


def _pathlike(name: str) -> bool:
    """A local path, not a hub repo id ("org/name" or a bare legacy name):
    the rule :func:`~storyrl.models.hub.require_hub_model` follows."""
    return Path(name).expanduser().exists() or not looks_like_repo_id(name)


def _model_piece(name: str, label: str, hint: str | None, required: bool) -> Piece:
    """A model given as a hub repo id or a local directory."""
    if _pathlike(name):
        return Piece("path", name, label, hint or f"the local model directory {name}", required)
    repo_id = name.removeprefix("hf-hub:").rstrip("/")
    return Piece("hub", repo_id, label, f"hf download {repo_id}", required)



def _data_piece(path: str, label: str, data_format: str | None = None) -> Piece:
    hint = VWP_URL if (data_format == "vwp" or "vwp" in path.lower()) else VIST_URL
    return Piece("path", path, label, hint, True)



def _four_bit_piece() -> Piece:
    return Piece("package", "bitsandbytes", "bitsandbytes (load_in_4bit)", QUANT_HINT, True)
