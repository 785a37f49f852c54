"""Fail fast when a model must come from an unreachable Hugging Face hub.

Offline, a hub download retries for about 50 s (and 60 lines of warnings)
before failing with an error that names neither the model nor what to do.
:func:`require_hub_model` is called before every hub download: it decides
once per process whether the hub can be reached (``HF_HUB_OFFLINE=1`` means
no; otherwise a ~3 s TCP connect to the endpoint, cached), and when it cannot
and the model is not in the local cache it raises :class:`HubUnreachableError`
at once, one line naming the model and what to do. An unreachable hub also
turns on huggingface_hub's offline mode, so cached models load at once.
Local paths are never probed.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["HubUnreachableError", "hub_reachable", "local_copy_hint", "looks_like_repo_id", "open_clip_hub_id",
           "require_hub_model", "timm_hub_id"]

PROBE_TIMEOUT_S = 3.0
_REACHABLE: bool | None = None
_SAVED_OFFLINE: bool | None = None  # huggingface_hub's offline flag before an unreachable hub switched it on
_LOCK = threading.Lock()


class HubUnreachableError(ValueError):
    """A model is neither local nor cached, and the hub cannot be reached."""


def _env_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        return False
    if _SAVED_OFFLINE is not None:  # the user's setting, not the switch of an unreachable hub
        return bool(_SAVED_OFFLINE)
    return bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the endpoint's host (or to the HTTPS proxy,
    when one is set) opens within ``timeout``."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    parsed = urlparse(proxy if proxy and "://" in proxy else url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_reachable() -> bool:
    """False when ``HF_HUB_OFFLINE`` is set or the endpoint does not answer;
    the probe runs once per process. An unreachable hub switches
    huggingface_hub to offline mode for the rest of the process, so that
    models already in the cache load from it at once instead of retrying."""
    global _REACHABLE, _SAVED_OFFLINE
    with _LOCK:
        if _REACHABLE is None and not _env_offline():
            _REACHABLE = _probe(endpoint())
            if not _REACHABLE:
                try:
                    from huggingface_hub import constants
                except ImportError:  # pragma: no cover - huggingface_hub is a dependency
                    pass
                else:
                    _SAVED_OFFLINE = constants.HF_HUB_OFFLINE
                    constants.HF_HUB_OFFLINE = True
        return bool(_REACHABLE) and not _env_offline()


def _reset() -> None:
    """Forget the probe's answer and undo its offline switch (tests)."""
    global _REACHABLE, _SAVED_OFFLINE
    with _LOCK:
        if _SAVED_OFFLINE is not None:
            from huggingface_hub import constants

            constants.HF_HUB_OFFLINE = _SAVED_OFFLINE
        _REACHABLE = _SAVED_OFFLINE = None


def _cache_dir() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover
        return Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"


def in_cache(repo_id: str) -> bool:
    """Whether the local hub cache holds a snapshot of ``repo_id`` (any revision)."""
    snapshots = _cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    try:
        return any(any(s.iterdir()) for s in snapshots.iterdir() if s.is_dir())
    except OSError:
        return False


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` can be a hub repo id (``name`` or ``org/name``):
    absolute, relative (``./``, ``../``), home (``~``) and deeper paths cannot."""
    name = name.removeprefix("hf-hub:").rstrip("/")
    return bool(name) and not name.startswith((".", "/", "~")) and name.count("/") <= 1 and "\\" not in name


def require_hub_model(name: str, *, what: str = "model", hint: str = "pass a local directory instead") -> None:
    """Raise :class:`HubUnreachableError` when ``name`` (a hub repo id or a
    local directory) would need a download from an unreachable hub.

    A local path, or a repo already in the local cache, passes without a
    probe. ``what`` names the thing ("model", "timm backbone", ...);
    ``hint`` is what the command offers instead (e.g. ``--no-pretrained``)."""
    if not name or Path(name).expanduser().exists() or not looks_like_repo_id(name):
        return  # a local path (or a missing one, the loader's to report): never probed
    repo_id = name.removeprefix("hf-hub:").rstrip("/")
    # The probe comes first even for a cached repo: an unreachable hub turns
    # on offline mode, so the cached copy loads without transformers' retries.
    if hub_reachable() or in_cache(repo_id):
        return
    why = "HF_HUB_OFFLINE is set" if _env_offline() else f"{endpoint()} cannot be reached"
    raise HubUnreachableError(
        f"{what} {repo_id!r} is not in the local Hugging Face cache ({_cache_dir()}) and {why}: {hint}, "
        "or run once with network access (HF_HUB_OFFLINE unset) to download it")


def local_copy_hint(option: str, flag: str | None = None) -> str:
    """The ``hint`` of :func:`require_hub_model` for a model named by a config
    key or reward option: ``set OPTION to a local copy's directory (FLAG DIR)``."""
    where = f" ({flag} DIR)" if flag else ""
    return f"set {option} to a local copy's directory{where}"


def timm_hub_id(name: str, pretrained_cfg_overlay: dict | None = None) -> str | None:
    """The hub repo the timm model ``name`` downloads its pretrained weights
    from, or None (a local file, a plain URL, an unknown name)."""
    if (pretrained_cfg_overlay or {}).get("file"):
        return None
    for prefix in ("hf-hub:", "hf_hub:"):
        if name.startswith(prefix):
            return name[len(prefix):].split("@")[0]
    try:
        import timm

        cfg = timm.models.get_pretrained_cfg(name)
    except Exception:  # unknown names are timm's error to report
        return None
    return getattr(cfg, "hf_hub_id", None) or None


def open_clip_hub_id(model: str, pretrained: str | None) -> str | None:
    """The hub repo open_clip downloads ``model``/``pretrained`` from, or None."""
    if model.startswith("hf-hub:"):
        return model[len("hf-hub:"):]
    if not pretrained or Path(pretrained).expanduser().exists():
        return None
    try:
        import open_clip

        cfg = open_clip.get_pretrained_cfg(model, pretrained)
    except Exception:
        return None
    parts = ((cfg or {}).get("hf_hub") or "").strip("/").split("/")
    return "/".join(parts[:2]) if len(parts) >= 2 else None
