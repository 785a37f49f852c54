"""Keep ``import torchvision`` working when its compiled ops cannot be loaded.

On CPU-only machines the only torchvision wheel may be a CUDA build whose
``_C`` extension does not load against the CPU torch. torchvision then dies at
import time (``operator torchvision::nms does not exist``) because
``_meta_registrations`` registers fake kernels for ops that were never defined,
which also breaks open_clip, timm and transformers' image processors.

Call :func:`install_torchvision_hook` (cheap, does not import torch) or
:func:`ensure_torchvision_ops` before torchvision is imported. If the native
ops load, nothing changes; otherwise pure-PyTorch ``nms``/``qnms`` are
registered under the ``torchvision`` namespace and a single
:class:`TorchvisionOpsFallbackWarning` is emitted.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
import warnings

__all__ = ["TorchvisionImportedTooEarlyWarning", "TorchvisionOpsFallbackWarning", "check_earlier_torchvision_import",
           "ensure_torchvision_ops", "install_torchvision_hook"]

# Schemas must match torchvision's C++ definitions exactly: its
# _meta_registrations.py and ops/boxes.py address these ops by name.
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_lock = threading.Lock()
_state: bool | None = None  # None: not decided yet; True: fallbacks registered
_library = None  # keeps the torch.library registrations alive


class TorchvisionOpsFallbackWarning(UserWarning):
    """torchvision's compiled ops failed to load; pure-PyTorch fallbacks are in use."""


class TorchvisionImportedTooEarlyWarning(UserWarning):
    """torchvision was imported (and broke) before storyrl could install its fallback."""


_checked_earlier_import = False


def check_earlier_torchvision_import() -> str | None:
    """Warn once if torchvision was imported before storyrl and is broken.

    Two states are recognised without importing anything: an import of
    torchvision that failed (``torchvision`` is not in :data:`sys.modules` but
    its submodules are: what transformers reports as ``Could not import module
    'AlbertModel'`` after ``import transformers`` came first on a CPU machine
    with a CUDA torchvision), and a torchvision imported without its compiled
    ops and without storyrl's fallback. Returns the warning's text, or None.
    """
    global _checked_earlier_import
    if _checked_earlier_import:
        return None
    _checked_earlier_import = True
    if "torchvision" not in sys.modules:
        if not any(name.startswith("torchvision.") for name in list(sys.modules)):
            return None
        what = ("an import of torchvision failed before storyrl was imported (its compiled ops do not load "
                "here); the next import gets storyrl's fallback")
    else:
        has_ops = getattr(sys.modules.get("torchvision.extension"), "_has_ops", None)
        try:
            broken = callable(has_ops) and not has_ops() and not _state
        except Exception:  # noqa: BLE001  (a stand-in module: nothing to judge)
            broken = False
        if not broken:
            return None
        what = "torchvision was imported before storyrl without its compiled ops (nms and friends will fail)"
    message = (f"{what}. Import storyrl before transformers, trl, timm or open_clip, or call "
               "storyrl.compat.ensure_torchvision_ops() first; a library that already caught the failure "
               "(transformers: \"Could not import module 'AlbertModel'\") may keep it until the process restarts.")
    warnings.warn(message, TorchvisionImportedTooEarlyWarning, stacklevel=3)
    return message


def _real_spec(name: str):
    # importlib.util.find_spec would re-enter our own hook; ask the other finders.
    for finder in sys.meta_path:
        if isinstance(finder, _TorchvisionHook) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, None)
        if spec is not None:
            return spec
    return None


def _find_extension() -> str | None:
    """Path of torchvision's compiled ``_C`` extension, located without importing torchvision."""
    spec = _real_spec("torchvision")
    for directory in (spec and spec.submodule_search_locations) or ():
        # Same lookup as torchvision's _get_extension_path: _C + any extension suffix.
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(directory, "_C" + suffix)
            if os.path.isfile(path):
                return path
    return None


def _load_native_ops(path: str) -> bool:
    """Load the extension the way torchvision itself does; True if its ops are now registered."""
    import torch

    try:
        torch.ops.load_library(path)
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def _nms(dets, scores, iou_threshold: float):
    """Greedy NMS with the semantics of torchvision's CPU kernel.

    Boxes are (x1, y1, x2, y2); a box is dropped when its IoU with an already kept,
    higher-scoring box is > iou_threshold (a NaN IoU from empty boxes never suppresses).
    Returns int64 indices sorted by decreasing score.
    """
    import torch

    torch._check(dets.dim() == 2 and dets.size(1) == 4, lambda: f"boxes should be [N, 4], got {tuple(dets.shape)}")
    torch._check(scores.dim() == 1 and scores.size(0) == dets.size(0), lambda: "scores should be [N] matching boxes")
    boxes = dets if dets.is_floating_point() else dets.float()
    order = torch.argsort(scores, descending=True, stable=True)
    x1, y1, x2, y2 = boxes[order].unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    keep = []
    # One vectorised IoU row per *kept* box: O(N) memory instead of an N x N matrix.
    rest = torch.arange(order.numel(), device=dets.device)
    while rest.numel():
        i, rest = rest[0], rest[1:]
        keep.append(i)
        w = (torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest])).clamp(min=0)
        h = (torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest])).clamp(min=0)
        inter = w * h
        rest = rest[~(inter / (areas[i] + areas[rest] - inter) > iou_threshold)]
    if not keep:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    return order[torch.stack(keep)]


def _register_fallbacks() -> list[str]:
    import torch

    global _library
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        _library.define(schema)
        # qnms receives int_repr() tensors; _nms promotes them to float like the C++ kernel.
        _library.impl(name, _nms, "CompositeExplicitAutograd")
    return list(_SCHEMAS)


def _ensure() -> bool:
    global _state
    with _lock:
        if _state is not None:
            return _state
        _state = False
        if "torchvision" in sys.modules:
            return False  # too late to help, and nothing to fix if it imported
        path = _find_extension()
        if path is None or _load_native_ops(path):
            return False
        names = _register_fallbacks()
        _state = True
    warnings.warn(
        f"torchvision's compiled ops failed to load ({path}); registered pure-PyTorch fallbacks for "
        f"{', '.join('torchvision::' + n for n in names)}. They are slower, and ops such as "
        "deform_conv2d, roi_pool and box_iou_rotated remain unavailable.",
        TorchvisionOpsFallbackWarning,
        stacklevel=3,
    )
    return True


def ensure_torchvision_ops() -> bool:
    """Make torchvision importable if its compiled ops cannot be loaded.

    Must run before torchvision is imported. Idempotent: the first call decides and
    later calls return the same answer. Returns True iff fallbacks were registered.
    """
    registered = _ensure()
    if registered:
        install_torchvision_hook()  # still needed to let torchvision.ops.nms use the fallback
    return registered


def _allow_fallback_ops() -> None:
    # torchvision.ops.nms refuses to run unless torchvision loaded its own _C library
    # (_assert_has_ops). Relax that check for ops/boxes.py only: flipping
    # extension._has_ops globally would break e.g. roi_align's pure-Python path.
    boxes = sys.modules.get("torchvision.ops.boxes")
    if boxes is not None:
        boxes._assert_has_ops = lambda: None


class _TorchvisionHook:
    """One-shot meta path finder: runs ensure just before torchvision is first imported.

    Duck-typed rather than subclassing importlib.abc.MetaPathFinder, whose import
    (importlib.resources, ...) would add ~10 ms to ``import storyrl``.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        # Resolve the spec ourselves rather than returning None: removing ourselves from
        # sys.meta_path mid-iteration would make importlib skip the next finder.
        spec = _real_spec(fullname)
        if not (_ensure() and spec is not None and spec.loader is not None):
            _uninstall_hook()
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            _uninstall_hook()
            exec_module(module)
            _allow_fallback_ops()

        # The hook stays until torchvision really executes: a probe such as
        # importlib.util.find_spec("torchvision") (transformers' and peft's
        # availability checks) asks for a spec it never loads, and the import
        # that follows gets a spec of its own.
        spec.loader.exec_module = exec_then_patch
        return spec


def _uninstall_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionHook)]


def install_torchvision_hook() -> None:
    """Call :func:`ensure_torchvision_ops` automatically when torchvision is first imported.

    Cheap: torch is only imported once torchvision itself is. No-op if torchvision
    is already imported or the hook is already installed.
    """
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())
