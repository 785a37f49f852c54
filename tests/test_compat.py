"""Tests for storyrl.compat. Import state is process-global, so most run in a fresh interpreter."""

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_py(code: str) -> dict:
    """Run `code` in a fresh interpreter; it must print one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", textwrap.dedent(code)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def native_ops_load() -> bool:
    """Whether torchvision's compiled ops load on this machine (without our help)."""
    return run_py("""
        import json, storyrl.compat as c
        path = c._find_extension()
        print(json.dumps(path is not None and c._load_native_ops(path)))
    """)


def test_hook_does_not_import_torch():
    out = run_py("""
        import json, sys
        import storyrl.compat as c
        c.install_torchvision_hook()
        c.install_torchvision_hook()  # idempotent
        hooks = sum(isinstance(f, c._TorchvisionHook) for f in sys.meta_path)
        print(json.dumps({"torch": "torch" in sys.modules, "hooks": hooks}))
    """)
    assert out == {"torch": False, "hooks": 1}


def test_hook_makes_torchvision_timm_open_clip_importable():
    out = run_py("""
        import json, sys, warnings
        import storyrl.compat as c
        c.install_torchvision_hook()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torchvision, timm, open_clip
        import torch
        # boxes: 3 is a duplicate of 0 with a higher score; 1 overlaps 0/3 (IoU 81/119 ~ 0.68);
        # 2 is disjoint; 4 overlaps 2 a little (IoU 25/175 ~ 0.14).
        boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30],
                              [0, 0, 10, 10], [25, 25, 35, 35]], dtype=torch.float32)
        scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.6])
        classes = torch.tensor([0, 1, 0, 0, 0])
        print(json.dumps({
            "nms": torchvision.ops.nms(boxes, scores, 0.5).tolist(),
            "nms_low": torchvision.ops.nms(boxes, scores, 0.1).tolist(),
            "batched": torchvision.ops.batched_nms(boxes, scores, classes, 0.5).tolist(),
            "empty": torchvision.ops.nms(boxes[:0], scores[:0], 0.5).tolist(),
            "warnings": sum(issubclass(w.category, c.TorchvisionOpsFallbackWarning) for w in caught),
            "hook_left": any(isinstance(f, c._TorchvisionHook) for f in sys.meta_path),
        }))
    """)
    assert out["nms"] == [3, 2, 4]
    assert out["nms_low"] == [3, 2]
    assert out["batched"] == [3, 1, 2, 4]  # box 1 is alone in its class
    assert out["empty"] == []
    assert out["warnings"] == (0 if native_ops_load() else 1)
    assert not out["hook_left"]


def test_ensure_warns_once():
    out = run_py("""
        import json, sys, warnings
        import storyrl.compat as c
        c._uninstall_hook()  # `import storyrl` installs it; ensure alone must suffice
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [c.ensure_torchvision_ops() for _ in range(3)]
            import torchvision
            results.append(c.ensure_torchvision_ops())
            import torch
            keep = torchvision.ops.nms(torch.tensor([[0., 0, 1, 1], [0, 0, 1, 1]]), torch.tensor([0.1, 0.2]), 0.5)
        print(json.dumps({
            "results": results,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, c.TorchvisionOpsFallbackWarning)],
            "keep": keep.tolist(),
        }))
    """)
    assert out["keep"] == [1]
    if native_ops_load():
        assert out["results"] == [False] * 4 and out["warnings"] == []
    else:
        assert out["results"] == [True] * 4
        assert len(out["warnings"]) == 1
        assert "torchvision::nms" in out["warnings"][0] and "torchvision::qnms" in out["warnings"][0]


def test_no_fallback_when_native_ops_load():
    out = run_py("""
        import json, sys, warnings
        import storyrl.compat as c
        c._load_native_ops = lambda path: True  # pretend the compiled extension loaded
        hooks = lambda: sum(isinstance(f, c._TorchvisionHook) for f in sys.meta_path)
        before = hooks()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = c.ensure_torchvision_ops()
        import torch
        print(json.dumps({
            "result": result,
            "warnings": len(caught),
            "library": c._library is not None,
            "hooks_added": hooks() - before,
            "nms_defined": hasattr(torch.ops.torchvision, "nms"),
        }))
    """)
    assert out == {"result": False, "warnings": 0, "library": False, "hooks_added": 0, "nms_defined": False}


def test_noop_when_torchvision_already_imported():
    out = run_py("""
        import json, sys, types, warnings
        import storyrl.compat as c
        sys.modules["torchvision"] = types.ModuleType("torchvision")  # stand-in: "already imported"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = c.ensure_torchvision_ops()
        print(json.dumps({"result": result, "warnings": len(caught), "torch": "torch" in sys.modules}))
    """)
    assert out == {"result": False, "warnings": 0, "torch": False}


def _reference_nms(boxes, scores, thr):

    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    area = lambda b: float((b[2] - b[0]) * (b[3] - b[1]))
    keep = []
    for i in order:
        for k in keep:
            w = max(0.0, float(min(boxes[i][2], boxes[k][2]) - max(boxes[i][0], boxes[k][0])))
            h = max(0.0, float(min(boxes[i][3], boxes[k][3]) - max(boxes[i][1], boxes[k][1])))
            union = area(boxes[i]) + area(boxes[k]) - w * h
            if union > 0 and w * h / union > thr:
                break
        else:
            keep.append(i)
    return keep


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("thr", [0.0, 0.3, 0.7])
def test_nms_fallback_matches_reference(seed, thr):
    torch = pytest.importorskip("torch")
    from storyrl.compat import _nms

    g = torch.Generator().manual_seed(seed)
    n = 60
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64) * 50
    wh = torch.rand(n, 2, generator=g, dtype=torch.float64) * 20 + 0.5
    boxes = torch.cat([xy, xy + wh], 1)
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    keep = _nms(boxes, scores, thr)
    assert keep.dtype == torch.int64
    assert keep.tolist() == _reference_nms(boxes.tolist(), scores.tolist(), thr)
    # integer inputs (what qnms receives) take the same path
    ib, isc = boxes.round().to(torch.uint8), (scores * 255).to(torch.uint8)
    assert _nms(ib, isc, thr).tolist() == _reference_nms(ib.tolist(), isc.tolist(), thr)


def test_hook_survives_an_availability_probe():
    """transformers and peft probe with importlib.util.find_spec("torchvision")
    before importing it; the real import must still get the nms fallback."""
    out = run_py("""
        import importlib.util, json, sys
        import storyrl.compat as c
        c.install_torchvision_hook()
        probed = importlib.util.find_spec("torchvision") is not None
        import torch, torchvision
        boxes = torch.tensor([[0, 0, 10, 10], [0, 0, 10, 10]], dtype=torch.float32)
        print(json.dumps({
            "probed": probed,
            "nms": torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8]), 0.5).tolist(),
            "hook_left": any(isinstance(f, c._TorchvisionHook) for f in sys.meta_path),
        }))
    """)
    assert out == {"probed": True, "nms": [0], "hook_left": False}


@pytest.mark.parametrize("state, warned", [
    ("clean", False),
    ("failed", True),  # torchvision's import died: its submodules stay, torchvision does not
    ("imported-without-ops", True),
    ("imported-with-ops", False),
])
def test_torchvision_broken_before_storyrl_is_warned_once(state, warned):
    """Issue 21 item 7: torchvision broken by an import before storyrl's is named, with what to do."""
    out = run_py(f"""
        import json, sys, types, warnings
        state = {state!r}
        ext = types.ModuleType("torchvision.extension")
        ext._has_ops = lambda: state == "imported-with-ops"
        if state != "clean":
            sys.modules["torchvision.extension"] = ext
        if state.startswith("imported"):
            sys.modules["torchvision"] = types.ModuleType("torchvision")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import storyrl
            import storyrl.compat as c
            again = c.check_earlier_torchvision_import()
        mine = [str(w.message) for w in caught if w.category is c.TorchvisionImportedTooEarlyWarning]
        print(json.dumps({{"messages": mine, "again": again}}))
    """)
    assert out["again"] is None
    assert len(out["messages"]) == int(warned)
    if warned:
        assert "Import storyrl before transformers" in out["messages"][0]
        assert "storyrl.compat.ensure_torchvision_ops()" in out["messages"][0]


def test_transformers_before_storyrl_is_detected_and_recovers():
    """The real case: on a CPU machine with a CUDA torchvision, transformers' AlbertModel fails
    before storyrl is imported; import storyrl says so and the next import works."""
    if native_ops_load():
        pytest.skip("torchvision's compiled ops load here: nothing breaks")
    out = run_py("""
        import json, warnings
        import transformers
        try:
            from transformers import AlbertModel
            first = "ok"
        except Exception as exc:
            first = str(exc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import storyrl
            from storyrl.compat import TorchvisionImportedTooEarlyWarning
            from transformers import AlbertModel
        print(json.dumps({"first": first,
                          "warned": sum(w.category is TorchvisionImportedTooEarlyWarning for w in caught)}))
    """)
    assert "AlbertModel" in out["first"] and out["warned"] == 1
