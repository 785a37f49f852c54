"""``storyrl doctor --fetch``: download the missing required pieces that can
be downloaded (hub snapshots, spaCy pipelines, storyrl assets)."""

from __future__ import annotations

from collections.abc import Callable

from storyrl.doctor.checks import _check, check
from storyrl.doctor.gpu import GpuFacts
from storyrl.doctor.pieces import Piece, Requirements
from storyrl.models.hub import hub_reachable

def _fetch_hub(piece: Piece) -> None:
    from huggingface_hub import snapshot_download

    if not hub_reachable():
        from storyrl.models.hub import _env_offline, endpoint

        raise RuntimeError("HF_HUB_OFFLINE is set" if _env_offline() else f"{endpoint()} cannot be reached")
    snapshot_download(piece.target)


def _fetch_spacy(piece: Piece) -> None:
    from storyrl.models.hub import _probe

    # spaCy's pipelines are wheels on GitHub releases; without it pip retries for a minute.
    if not _probe("https://github.com"):
        raise RuntimeError("github.com cannot be reached")
    from spacy.cli import download

    try:
        download(piece.target)
    except SystemExit as exc:  # spaCy's CLI exits when pip fails
        raise RuntimeError(f"python -m spacy download {piece.target} failed (exit {exc.code})") from None


def _fetch_asset(piece: Piece) -> None:
    from storyrl.assets import download_assets

    download_assets([piece.target])


_FETCHERS = {"hub": _fetch_hub, "spacy": _fetch_spacy, "asset": _fetch_asset}


def fetch(reqs: Requirements, report: Callable[[str], None] | None = None,
          gpu: GpuFacts | None = None) -> Requirements:
    """Download every missing required piece that can be downloaded (hub
    snapshots, spaCy pipelines, assets); optional ones are left alone (they
    can be gigabytes the paper's setup does not use). A failure is recorded
    on its piece (``fetch_error``), never raised. ``report(line)`` is told
    what is being fetched (downloads take minutes). Then check again
    (``gpu``: as for :func:`~storyrl.doctor.checks.check`)."""
    from storyrl.rewards.base import one_line

    for piece in reqs.pieces:
        if piece.present is None and piece.fetchable:
            _check(piece)
        if piece.present or not piece.fetchable or not piece.required:
            continue
        if report is not None:
            report(f"fetching {piece.label} ({piece.target}) ...")
        try:
            _FETCHERS[piece.kind](piece)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported per piece, the others still run
            piece.fetch_error = one_line(exc)
    return check(reqs, gpu)
