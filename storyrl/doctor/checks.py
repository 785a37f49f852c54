"""The lookups: is each piece in the Hugging Face cache, installed, on
disk? GPU torch and bitsandbytes are judged from :mod:`storyrl.doctor.gpu`'s facts."""

from __future__ import annotations

from pathlib import Path

from storyrl.doctor.gpu import GpuFacts, check_pieces, gpu_facts
from storyrl.doctor.pieces import Piece, Requirements
from storyrl.models.hub import in_cache

#: How long a remote reward's server may take to answer GET /health: the
#: doctor answers in seconds, and a server that is up answers at once.
SERVER_TIMEOUT_S = 3.0


def _hub_cache() -> Path:
    from storyrl.models import hub

    return hub._cache_dir()


def _installed(module: str) -> str | None:
    """Where an importable module lives, or None (nothing is imported)."""
    from importlib.util import find_spec

    try:
        spec = find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else next(iter(spec.submodule_search_locations
                                                                                 or []), None)
    return str(Path(origin).parent) if origin and origin.endswith("__init__.py") else str(origin or module)


def _check_spacy(piece: Piece) -> None:
    from storyrl.noun_phrases import PipelineNotInstalled, require_pipeline

    try:
        require_pipeline(piece.target)
    except PipelineNotInstalled as exc:
        piece.present, piece.where = False, str(exc).split(";")[0].split(":")[0]
        if piece.target == "en_core_web_trf" and _installed("en_core_web_sm"):
            piece.where += ("; en_core_web_sm is installed: spacy_pipeline: en_core_web_sm uses it "
                            "(faster, not the authors')")
        return
    piece.present, piece.where = True, _installed(piece.target) or piece.target


def _check_server(piece: Piece, timeout: float | None = None) -> None:
    """GET the server's /health, as the remote reward's own setup does: a
    2xx answer, or 404/405 from a server without /health, is up; a redirect
    is not followed (the reward does not follow one either)."""
    import urllib.error
    import urllib.request

    from storyrl.rewards.base import one_line

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None  # the 3xx surfaces as an HTTPError with its own status

    url, timeout = piece.target, SERVER_TIMEOUT_S if timeout is None else timeout
    try:
        with urllib.request.build_opener(NoRedirect).open(url, timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        piece.present = False
        piece.where = f"down: {url}: {one_line(reason) if isinstance(reason, BaseException) else reason}"
        return
    piece.present = 200 <= status < 300 or status in (404, 405)
    piece.where = f"{url} answers (HTTP {status})" if piece.present else f"{url} answers HTTP {status}"


def _check(piece: Piece) -> None:
    if piece.kind == "server":
        _check_server(piece)
    elif piece.kind == "hub":
        folder = _hub_cache() / f"models--{piece.target.replace('/', '--')}"
        piece.present = in_cache(piece.target)
        piece.where = str(folder) if piece.present else f"not in the Hugging Face cache ({_hub_cache()})"
    elif piece.kind == "spacy":
        _check_spacy(piece)
    elif piece.kind == "asset":
        from storyrl.assets import asset_path

        try:
            piece.present, piece.where = True, str(asset_path(piece.target))
        except FileNotFoundError:
            from storyrl.assets import cache_dir

            piece.present, piece.where = False, f"not in {cache_dir()}"
    elif piece.kind == "path":
        if piece.target.startswith("("):  # a setting, not a path: nothing configured
            piece.present, piece.where = False, "not configured"
            return
        path = Path(piece.target).expanduser()
        piece.present = path.exists()
        piece.where = str(path.resolve()) if piece.present else f"no such file or directory: {piece.target}"
    elif piece.kind == "package":
        if ":" in piece.target:  # cannot be looked up (see _clip_pieces)
            piece.present, piece.where = False, "cannot be checked offline"
            return
        location = _installed(piece.target)
        piece.present, piece.where = location is not None, location or f"{piece.target} is not installed"
    else:  # pragma: no cover - every kind above
        raise ValueError(f"unknown piece kind {piece.kind!r}")


def _needs_gpu_facts(piece: Piece) -> bool:
    return piece.kind == "torch" or piece.key == ("package", "bitsandbytes")


def check(reqs: Requirements, gpu: GpuFacts | None = None) -> Requirements:
    """Look every piece up (cache, packages, files); nothing is loaded or
    downloaded. GPU torch and bitsandbytes are judged from ``gpu``
    (:func:`~storyrl.doctor.gpu.gpu_facts`, read here when not given and needed)."""
    for piece in reqs.pieces:
        if not _needs_gpu_facts(piece):
            _check(piece)
    if any(_needs_gpu_facts(p) for p in reqs.pieces):
        check_pieces(gpu if gpu is not None else gpu_facts(), reqs)
    return reqs

