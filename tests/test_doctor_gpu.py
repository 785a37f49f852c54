"""storyrl doctor's GPU lines: torch's build, each CUDA device (name, memory,
compute capability, bf16, fp16) and bitsandbytes (version, CUDA backend, a
4-bit op), each OK / WARN / MISSING / optional by what the named configs need,
and the exit status that follows. The machine is simulated (torch.cuda's
functions and bitsandbytes monkeypatched: an H100, a T4 without bf16, no
GPU; bitsandbytes present, missing, broken); one test runs unpatched."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from test_doctor import cache_model, env  # noqa: F401 - env: offline caches, no GPU, no bitsandbytes

from storyrl.cli.doctor import doctor
from storyrl.doctor import gpu as gpu_module

H100 = ("NVIDIA H100 80GB HBM3", 79.2, (9, 0), True)
T4 = ("Tesla T4", 14.6, (7, 5), False)


def simulate_gpu(monkeypatch, torch_module, name, gib, capability, bf16, count=1, fp16_error=None, cuda="12.4"):
    """``count`` CUDA devices like this one, as torch.cuda reports them. The fp16
    matmul cannot run here: it succeeds, or raises ``fp16_error``."""
    cuda_api = torch_module.cuda
    monkeypatch.setattr(torch_module.version, "cuda", cuda)
    monkeypatch.setattr(cuda_api, "is_available", lambda: True)
    monkeypatch.setattr(cuda_api, "device_count", lambda: count)
    monkeypatch.setattr(cuda_api, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=name, total_memory=int(gib * 2 ** 30)))
    monkeypatch.setattr(cuda_api, "get_device_capability", lambda i: capability)
    # like torch >= 2.3: emulated bf16 counts as supported unless asked not to
    monkeypatch.setattr(cuda_api, "is_bf16_supported", lambda including_emulation=True: bf16 or including_emulation)

    def fp16_probe(torch_module, index):
        if fp16_error:
            raise RuntimeError(fp16_error)

    monkeypatch.setattr(gpu_module, "_fp16_probe", fp16_probe)


def fake_bitsandbytes(monkeypatch, cuda_backend=True, four_bit_error=None, version="0.50.2"):
    """An importable bitsandbytes; its 4-bit round trip on a simulated CUDA
    device is recorded (and fails with ``four_bit_error``); on the CPU the
    doctor's real probe runs against an exact fake quantiser."""
    module = types.ModuleType("bitsandbytes")
    module.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)
    module.__version__ = version
    module.cextension = types.ModuleType("bitsandbytes.cextension")
    module.cextension.lib = types.SimpleNamespace(compiled_with_cuda=cuda_backend)
    functional = types.ModuleType("bitsandbytes.functional")
    functional.quantize_4bit = lambda x, quant_type: (x.clone(), None)
    functional.dequantize_4bit = lambda packed, state: packed
    module.functional = functional
    monkeypatch.setitem(sys.modules, "bitsandbytes", module)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", functional)
    monkeypatch.setitem(sys.modules, "bitsandbytes.cextension", module.cextension)
    devices = []
    real_probe = gpu_module._four_bit_probe

    def four_bit_probe(torch_module, device):
        devices.append(device)
        if device == "cpu":
            return real_probe(torch_module, device)
        if four_bit_error:
            raise RuntimeError(four_bit_error)

    monkeypatch.setattr(gpu_module, "_four_bit_probe", four_bit_probe)
    return devices


class _BrokenImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "bitsandbytes" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("CUDA Setup failed despite GPU being available.\nInspect the output above")


def broken_bitsandbytes(monkeypatch):
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenImport(), *sys.meta_path])


def run(*args):
    result = CliRunner().invoke(doctor, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def lines(output: str) -> dict[str, tuple[str, str]]:
    """{label: (status, detail)} of the GPU lines (torch, cuda:N ..., bitsandbytes)."""
    found = {}
    for line in output.splitlines():
        parts = line.split(maxsplit=1)
        if len(parts) == 2 and parts[0] in ("OK", "WARN", "MISSING", "optional"):
            rest = parts[1]
            for label in ("torch", "bitsandbytes") + tuple(f"cuda:{i} " for i in range(4)):
                if rest.startswith(label):
                    head, _, detail = rest.partition("  ")
                    found[head.strip()] = (parts[0], detail.strip())
    return found


@pytest.fixture
def rl_4bit(env, tmp_path):  # noqa: F811
    """An RL config needing a GPU and 4-bit, every other piece present."""
    cache_model(env["cache"], "org/policy")
    (tmp_path / "train.json").write_text("[]")
    config = tmp_path / "rl.yaml"
    config.write_text("algorithm: grpo\noutput_dir: out\ndata: train.json\nmodel: org/policy\n"
                      "rewards: [repetition]\nload_in_4bit: true\n")
    return str(config)


def test_h100_with_bitsandbytes_passes_a_4bit_rl_config(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)
    probed = fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 0, result.output
    found = lines(result.output)
    assert found["torch"] == ("OK", f"torch {torch.__version__}, a CUDA 12.4 build; 1 usable CUDA device(s): "
                                    "NVIDIA H100 80GB HBM3")
    assert found["cuda:0 NVIDIA H100 80GB HBM3"] == (
        "OK", "79.2 GiB, compute capability 9.0, bf16 yes, fp16 yes")
    assert found["bitsandbytes"] == ("OK", "0.50.2, CUDA backend; 4-bit op on cuda:0 works")
    assert probed == ["cuda:0"]
    assert "get it" not in result.output  # nothing to get
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert data["ok"] and data["gpu"]["cuda_build"] == "12.4"
    assert data["gpu"]["devices"] == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "total_gib": 79.2,
                                       "capability": [9, 0], "bf16": True, "fp16": True, "fp16_error": ""}]
    assert data["gpu"]["bitsandbytes"]["four_bit"] and data["gpu"]["bitsandbytes"]["cuda_backend"]
    assert [line["status"] for line in data["gpu"]["lines"]] == ["OK", "OK", "OK"]


def test_t4_has_no_native_bf16(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *T4, count=2)
    fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 0, result.output  # a warning, not a failure: fp16 works
    found = lines(result.output)
    # is_bf16_supported() alone says yes on a T4 (emulation): the doctor asks for native support
    for index in (0, 1):
        assert found[f"cuda:{index} Tesla T4"] == (
            "WARN", "14.6 GiB, compute capability 7.5, bf16 no (emulated, slow: use fp16), fp16 yes")
    assert found["torch"][1].endswith("2 usable CUDA device(s): Tesla T4")


def test_no_gpu_fails_a_config_that_needs_cuda_and_4bit(monkeypatch, rl_4bit):
    probed = fake_bitsandbytes(monkeypatch, cuda_backend=False)  # what a CPU machine's bitsandbytes loads
    monkeypatch.setattr(torch.version, "cuda", None)
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    found = lines(result.output)
    assert found["torch"] == ("MISSING", f"torch {torch.__version__}, a CPU build")
    assert found["bitsandbytes"] == ("MISSING", "0.50.2, no CUDA backend; 4-bit op on cpu works "
                                                "(load_in_4bit needs a CUDA device)")
    assert probed == ["cpu"]  # the doctor's real round trip ran, on the CPU
    assert not any(label.startswith("cuda:") for label in found)
    assert "needed by rl.yaml (load_in_4bit); get it: a CUDA build of torch: https://pytorch.org/" in result.output
    assert "needed by rl.yaml; get it: a CUDA device (see torch's line)" in result.output  # installed already
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert data["missing"] == ["GPU torch (CUDA available)", "bitsandbytes (load_in_4bit)"]


def test_no_gpu_is_fine_for_a_cpu_config(monkeypatch, env):  # noqa: F811
    monkeypatch.setattr(torch.version, "cuda", None)
    result = run("-m", "repetition")
    assert result.exit_code == 0
    found = lines(result.output)
    assert found["torch"] == ("OK", f"torch {torch.__version__}, a CPU build (nothing named needs a GPU)")
    assert found["bitsandbytes"] == ("optional", "not installed")
    fake_bitsandbytes(monkeypatch, cuda_backend=False)
    found = lines(run("-m", "repetition").output)
    assert found["bitsandbytes"][0] == "OK"
    # a model reward runs on the CPU too: a warning, not a failure
    result = run("-m", "clipscore")
    assert lines(result.output)["torch"] == (
        "WARN", f"torch {torch.__version__}, a CPU build; models run on the CPU (slower)")
    assert "MISSING   torch" not in result.output


def test_cuda_build_that_sees_no_gpu_warns(monkeypatch, env):  # noqa: F811
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    result = run("-m", "repetition")
    assert result.exit_code == 0
    assert lines(result.output)["torch"] == (
        "WARN", f"torch {torch.__version__}, a CUDA 13.0 build, but no GPU is visible")
    assert "get it: a visible GPU: check nvidia-smi" in result.output


def test_bitsandbytes_missing_fails_only_when_4bit_is_needed(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)  # env: bitsandbytes is not importable
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    assert lines(result.output)["bitsandbytes"] == ("MISSING", "not installed")
    assert 'needed by rl.yaml; get it: pip install -e ".[quant]"' in result.output
    result = run("-m", "repetition")
    assert result.exit_code == 0
    assert lines(result.output)["bitsandbytes"] == ("optional", "not installed")


def test_bitsandbytes_broken(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)
    broken_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    detail = "import failed: CUDA Setup failed despite GPU being available. Inspect the output above"
    assert lines(result.output)["bitsandbytes"] == ("MISSING", detail)
    assert "get it: pip install -U bitsandbytes" in result.output
    result = run("-m", "repetition")
    assert result.exit_code == 0
    assert lines(result.output)["bitsandbytes"] == ("WARN", detail)


def test_bitsandbytes_without_cuda_backend_on_a_gpu(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)
    fake_bitsandbytes(monkeypatch, cuda_backend=False, four_bit_error="Method 'cquantize_blockwise_fp16_nf4' "
                      "not available in CPU-only version of bitsandbytes.")
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    status, detail = lines(result.output)["bitsandbytes"]
    assert status == "MISSING"
    assert detail.startswith("0.50.2, no CUDA backend; 4-bit op on cuda:0 failed: Method 'cquantize")
    assert lines(run("-m", "repetition").output)["bitsandbytes"][0] == "WARN"


def test_card_without_kernels_in_this_torch(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, "NVIDIA B200", 178.4, (10, 0), True,
                 fp16_error="CUDA error: no kernel image is available for execution on the device")
    fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    found = lines(result.output)
    assert found["torch"] == ("MISSING", f"torch {torch.__version__}, a CUDA 12.4 build: no device runs fp16 "
                                         "kernels (see the device lines)")
    assert found["cuda:0 NVIDIA B200"] == ("MISSING", "178.4 GiB, compute capability 10.0, bf16 yes, fp16 failed: "
                                                      "CUDA error: no kernel image is available for execution on "
                                                      "the device")
    assert "get it: a torch build with kernels for this card's compute capability" in result.output
    # 4-bit is tried where storyrl would run it: no usable GPU, so the CPU
    assert found["bitsandbytes"][1].endswith("4-bit op on cpu works (load_in_4bit needs a CUDA device)")
    result = run("-m", "repetition")
    assert result.exit_code == 0
    assert lines(result.output)["cuda:0 NVIDIA B200"][0] == "WARN"


def test_torch_is_imported_lazily():
    # --help and a config error answer without importing torch (seconds)
    code = ("import sys; from click.testing import CliRunner; from storyrl.cli import main\n"
            "r = CliRunner().invoke(main, ['doctor', '--help']); assert r.exit_code == 0, r.output\n"
            "r = CliRunner().invoke(main, ['doctor', '-m', 'nosuch']); assert r.exit_code == 2, r.output\n"
            "assert 'torch' not in sys.modules and 'bitsandbytes' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_this_machine_unpatched():
    # the real facts of whatever runs the tests (a CPU machine here)
    data = json.loads(run("--json", "-m", "repetition").output)
    gpu = data["gpu"]
    assert gpu["torch_version"] == torch.__version__ and gpu["cuda_build"] == torch.version.cuda
    assert len(gpu["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert [line["check"] for line in gpu["lines"]][::len(gpu["lines"]) - 1] == ["torch", "bitsandbytes"]
    assert data["ok"]  # repetition needs nothing; no GPU line fails it
    if not torch.cuda.is_available() and torch.version.cuda is None:
        assert gpu["lines"][0]["status"] == "OK"
    bnb = gpu["bitsandbytes"]
    assert bnb["state"] in ("ok", "missing", "broken")
    if bnb["state"] == "ok":
        import bitsandbytes

        assert bnb["version"] == bitsandbytes.__version__ and bnb["device"] in ("cpu", "cuda:0")


# -- the breaks a review found the tests above did not catch -----------------------------


@pytest.mark.parametrize("failing", ["device_count", "get_device_properties"])
def test_cuda_that_fails_to_answer_is_one_line_not_a_traceback(monkeypatch, rl_4bit, failing):
    # a driver too old for this torch build: torch.cuda raises RuntimeError, not ImportError
    simulate_gpu(monkeypatch, torch, *H100)
    fake_bitsandbytes(monkeypatch)
    message = "CUDA driver version is insufficient for CUDA runtime version"

    def fails(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(torch.cuda, failing, fails)
    result = run("--config", rl_4bit)  # run() re-raises anything but SystemExit
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    found = lines(result.output)
    assert found["torch"] == ("MISSING", f"torch {torch.__version__}, a CUDA 12.4 build, but CUDA failed: {message}")
    assert not any(label.startswith("cuda:") for label in found)
    assert "get it: a visible GPU: check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES" in result.output
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert not data["ok"] and data["gpu"]["cuda_error"] == message and data["gpu"]["devices"] == []
    result = run("-m", "repetition")  # nothing named needs the GPU: a warning
    assert result.exit_code == 0
    assert lines(result.output)["torch"][0] == "WARN"


def test_broken_bitsandbytes_on_a_good_gpu_fails_4bit(monkeypatch, rl_4bit, env):  # noqa: F811
    from storyrl.doctor import Requirements, check
    from storyrl.doctor.pieces import _four_bit_piece

    simulate_gpu(monkeypatch, torch, *H100)
    env["spacy"].add("bitsandbytes")  # installed, as pip sees it: importing it is what fails
    broken_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 1
    assert lines(result.output)["torch"][0] == "OK"
    assert lines(result.output)["bitsandbytes"][0] == "MISSING"
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert not data["ok"] and data["missing"] == ["bitsandbytes (load_in_4bit)"]
    # bitsandbytes is judged by its import and 4-bit op even where nothing named needs GPU torch
    reqs = Requirements()
    reqs.add(_four_bit_piece(), "gen.yaml")
    assert [p.label for p in check(reqs).missing()] == ["bitsandbytes (load_in_4bit)"]
    assert reqs.pieces[0].where.startswith("import failed: CUDA Setup failed")
    # and one without the CUDA backend, whose 4-bit op fails on the GPU, is missing too
    fake_bitsandbytes(monkeypatch, cuda_backend=False, four_bit_error="not available in CPU-only bitsandbytes")
    reqs = Requirements()
    reqs.add(_four_bit_piece(), "gen.yaml")
    assert [p.label for p in check(reqs).missing()] == ["bitsandbytes (load_in_4bit)"]
    # a working one, though pip's lookup were to miss it, is present
    env["spacy"].discard("bitsandbytes")
    fake_bitsandbytes(monkeypatch)
    reqs = Requirements()
    reqs.add(_four_bit_piece(), "gen.yaml")
    assert check(reqs).missing() == [] and reqs.pieces[0].present


def test_bf16_is_judged_per_device(monkeypatch, rl_4bit):
    # cuda:0 an H100 (native bf16), cuda:1 a T4 (emulated only); is_bf16_supported answers for cuda:0
    simulate_gpu(monkeypatch, torch, *H100, count=2)
    cards = {0: H100, 1: T4}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        name=cards[i][0], total_memory=int(cards[i][1] * 2 ** 30)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: cards[i][2])
    fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 0, result.output
    found = lines(result.output)
    assert found["cuda:0 NVIDIA H100 80GB HBM3"] == ("OK", "79.2 GiB, compute capability 9.0, bf16 yes, fp16 yes")
    assert found["cuda:1 Tesla T4"] == (
        "WARN", "14.6 GiB, compute capability 7.5, bf16 no (emulated, slow: use fp16), fp16 yes")
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert [d["bf16"] for d in data["gpu"]["devices"]] == [True, False]


def test_fp16_matmul_with_a_wrong_result_fails(monkeypatch, rl_4bit):
    real_probe = gpu_module._fp16_probe
    simulate_gpu(monkeypatch, torch, *H100, count=2)
    monkeypatch.setattr(gpu_module, "_fp16_probe", real_probe)  # the doctor's own probe runs
    real_ones = torch.ones

    class WrongCard:  # cuda:0 computes a wrong matmul; its result lands on the CPU here
        def __matmul__(self, other):
            return real_ones(16, 16) * 15

    def ones(*size, dtype=None, device=None, **kwargs):
        if device == "cuda:0":
            return WrongCard()
        if device == "cuda:1":  # a good card
            return real_ones(*size)
        return real_ones(*size, dtype=dtype, device=device, **kwargs)

    monkeypatch.setattr(torch, "ones", ones)
    probed = fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 0, result.output  # cuda:1 is usable
    found = lines(result.output)
    assert found["cuda:0 NVIDIA H100 80GB HBM3"] == (
        "WARN", "79.2 GiB, compute capability 9.0, bf16 yes, fp16 failed: fp16 matmul gave 3840.0, not 4096")
    assert found["cuda:1 NVIDIA H100 80GB HBM3"][0] == "OK"
    assert found["torch"][1].endswith("1 usable CUDA device(s): NVIDIA H100 80GB HBM3")
    assert probed[-1] == "cuda:1"
    data = json.loads(run("--json", "--config", rl_4bit).output)
    assert [d["fp16"] for d in data["gpu"]["devices"]] == [False, True]


def _rows(output: str) -> list[tuple[str, str]]:
    """(status, label) of every table row (hint lines are indented)."""
    rows = []
    for line in output.splitlines():
        parts = [part for part in line.split("  ") if part.strip()]
        if len(parts) >= 2 and not line.startswith(" "):
            rows.append((parts[0].strip(), parts[1].strip()))
    return rows


def test_torch_and_bitsandbytes_appear_once_in_the_table(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)
    fake_bitsandbytes(monkeypatch)
    labels = [label for _, label in _rows(run("--config", rl_4bit).output)]
    assert [label for label in labels if "torch" in label or "bitsandbytes" in label] == ["torch", "bitsandbytes"]
    # missing: each hint once too
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_bitsandbytes(monkeypatch, cuda_backend=False)
    output = run("--config", rl_4bit).output
    labels = [label for _, label in _rows(output)]
    assert [label for label in labels if "torch" in label or "bitsandbytes" in label] == ["torch", "bitsandbytes"]
    assert output.count("get it: a CUDA build of torch") == 1
    assert output.count("get it: a CUDA device (see torch's line)") == 1


def test_present_pieces_say_ok(monkeypatch, rl_4bit):
    simulate_gpu(monkeypatch, torch, *H100)
    fake_bitsandbytes(monkeypatch)
    result = run("--config", rl_4bit)
    assert result.exit_code == 0
    rows = dict((label, status) for status, label in _rows(result.output))
    assert rows["rl.yaml policy model"] == "OK" and rows["rl.yaml data"] == "OK"
    assert set(rows.values()) == {"OK"}, result.output
