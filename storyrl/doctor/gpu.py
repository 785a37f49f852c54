"""The GPU facts ``storyrl doctor`` reports: torch's build, each visible CUDA
device (name, memory, compute capability, bf16, whether fp16 kernels run)
and bitsandbytes (version, CUDA backend, a 4-bit round trip), then a verdict
per line -- OK, WARN, MISSING or optional -- from what the named configs need.

torch and bitsandbytes are imported only when :func:`gpu_facts` runs, so the
doctor's ``--help`` and its config errors stay fast.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from storyrl.doctor.pieces import QUANT_HINT, TORCH_HINT, Piece, Requirements

# A bitsandbytes that imports badly or lacks this CUDA's library: usually older than the torch build.
REINSTALL_BNB = "pip install -U bitsandbytes (a release with a library for torch's CUDA version)"

NO_KERNELS = "a torch build with kernels for this card's compute capability (a newer CUDA build)"

#: Native bf16 needs compute capability 8.0 (Ampere) or newer; below that torch emulates it, slowly.
BF16_CAPABILITY = (8, 0)


@dataclass
class Device:
    index: int
    name: str
    total_gib: float
    capability: tuple[int, int]
    bf16: bool
    fp16: bool
    fp16_error: str = ""

    @property
    def label(self) -> str:
        return f"cuda:{self.index} {self.name}"


@dataclass
class Bitsandbytes:
    state: str  # "missing", "broken" (import failed) or "ok"
    version: str = ""
    cuda_backend: bool = False
    device: str = ""  # where the 4-bit round trip ran ("" when it did not)
    four_bit: bool = False
    error: str = ""


@dataclass
class GpuFacts:
    torch_version: str | None  # None: torch is not installed
    cuda_build: str | None  # torch.version.cuda: None for a CPU build
    devices: list[Device] = field(default_factory=list)
    bitsandbytes: Bitsandbytes = field(default_factory=lambda: Bitsandbytes("missing"))
    cuda_error: str = ""  # why CUDA could not be queried (driver, CUDA_VISIBLE_DEVICES)

    @property
    def usable(self) -> list[Device]:
        """Devices that ran an fp16 kernel: the ones storyrl's GPU paths can use."""
        return [d for d in self.devices if d.fp16]

    def build(self) -> str:
        if self.torch_version is None:
            return "not installed"
        kind = f"a CUDA {self.cuda_build} build" if self.cuda_build else "a CPU build"
        return f"{self.torch_version}, {kind}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _one_line(exc: BaseException) -> str:
    from storyrl.rewards.base import one_line

    return one_line(exc)


def _fp16_probe(torch: Any, index: int) -> None:
    """Run one fp16 matmul on the device; raises what CUDA raises (e.g. a torch
    build without kernels for this card: "no kernel image is available")."""
    a = torch.ones(16, 16, dtype=torch.float16, device=f"cuda:{index}")
    total = (a @ a).sum().item()
    if total != 16 ** 3:
        raise RuntimeError(f"fp16 matmul gave {total}, not {16 ** 3}")


def _bf16(torch: Any, index: int, capability: tuple[int, int]) -> bool:
    """Native bf16 on device ``index``. torch.cuda.is_bf16_supported answers
    for the current device and, since torch 2.3, counts slow emulation as
    support unless told not to."""
    if index != 0:  # the current device of a fresh process is cuda:0
        return tuple(capability) >= BF16_CAPABILITY
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3: no emulation argument
        return bool(torch.cuda.is_bf16_supported())


def _devices(torch: Any) -> list[Device]:
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        capability = tuple(torch.cuda.get_device_capability(index))
        try:
            _fp16_probe(torch, index)
            fp16, error = True, ""
        except Exception as exc:  # noqa: BLE001 - reported on the device's line
            fp16, error = False, _one_line(exc)
        devices.append(Device(index, props.name, round(props.total_memory / 2 ** 30, 1), capability,
                              _bf16(torch, index, capability), fp16, error))
    return devices


@contextlib.contextmanager
def _quiet():
    """bitsandbytes logs and prints while importing (e.g. on CPU "Failed to load
    CPU gemm_4bit_forward ..."): the doctor's own line says what matters."""
    from storyrl.console import verbose

    if verbose():
        yield
        return
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _cuda_backend(bnb: Any) -> bool:
    """Whether bitsandbytes loaded its CUDA library (0.43+: ``cextension.lib``;
    older releases: ``COMPILED_WITH_CUDA``)."""
    try:  # imported by bitsandbytes' __init__ in every release seen; asked for by name all the same
        cextension = importlib.import_module("bitsandbytes.cextension")
    except Exception:  # noqa: BLE001 - no such module: report no CUDA backend
        cextension = getattr(bnb, "cextension", None)
    lib = getattr(cextension, "lib", None)
    return bool(getattr(lib, "compiled_with_cuda", False) or getattr(cextension, "COMPILED_WITH_CUDA", False))


def _four_bit_probe(torch: Any, device: str) -> None:
    """NF4-quantise a small fp16 matrix on ``device`` and back; raises when the
    op fails or the round trip is off by more than NF4's step allows."""
    import bitsandbytes.functional as bnb_functional

    x = torch.linspace(-1, 1, 64 * 64, dtype=torch.float16, device=device).reshape(64, 64)
    packed, state = bnb_functional.quantize_4bit(x, quant_type="nf4")
    error = (bnb_functional.dequantize_4bit(packed, state).float() - x.float()).abs().max().item()
    if not error <= 0.2:  # NF4's widest step is ~0.28 of a block's absmax (here <= 1)
        raise RuntimeError(f"4-bit round trip off by {error:.3f}")


def _bitsandbytes(torch: Any, devices: list[Device]) -> Bitsandbytes:
    from importlib.util import find_spec

    try:
        if find_spec("bitsandbytes") is None:
            return Bitsandbytes("missing")
    except (ImportError, ValueError):
        return Bitsandbytes("missing")
    try:
        with _quiet():
            import bitsandbytes as bnb
    except Exception as exc:  # noqa: BLE001 - a broken install (CUDA library, torch mismatch) is reported
        return Bitsandbytes("broken", error=_one_line(exc))
    facts = Bitsandbytes("ok", version=str(getattr(bnb, "__version__", "?")), cuda_backend=_cuda_backend(bnb))
    # On the first usable GPU; with none, on the CPU (bitsandbytes has CPU ops, storyrl's 4-bit loading does not).
    usable = [d for d in devices if d.fp16]
    facts.device = f"cuda:{usable[0].index}" if usable else "cpu"
    try:
        with _quiet():
            _four_bit_probe(torch, facts.device)
        facts.four_bit = True
    except Exception as exc:  # noqa: BLE001 - reported on the bitsandbytes line
        facts.error = _one_line(exc)
    return facts


def gpu_facts() -> GpuFacts:
    """Import torch (and bitsandbytes, when installed) and read the facts;
    never raises for a missing or broken piece (it becomes a fact)."""
    try:
        import torch
    except ImportError:
        return GpuFacts(None, None)
    facts = GpuFacts(torch.__version__, torch.version.cuda)
    try:
        if torch.cuda.is_available():
            facts.devices = _devices(torch)
    except Exception as exc:  # noqa: BLE001 - e.g. a driver too old for this build
        facts.cuda_error = _one_line(exc)
    facts.bitsandbytes = _bitsandbytes(torch, facts.devices)
    return facts


# -- verdicts ----------------------------------------------------------------------------


@dataclass
class Line:
    """One line of the GPU report; ``piece`` is the requirement it answers
    (for its owners and hint), if anything named needs it."""

    status: str  # "OK", "WARN", "MISSING" or "optional"
    label: str
    detail: str
    hint: str = ""
    piece: Piece | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "check": self.label, "detail": self.detail, "get": self.hint or None,
                "needed_by": list(self.piece.needed_by) if self.piece else []}


def _find(reqs: Requirements, kind: str, target: str) -> Piece | None:
    return next((p for p in reqs.pieces if p.key == (kind, target)), None)


def _problem(piece: Piece | None) -> str:
    """The status of something absent: MISSING when required, WARN when an
    optional piece wants it, optional when nothing named needs it."""
    if piece is None:
        return "optional"
    return "MISSING" if piece.required else "WARN"


def check_pieces(facts: GpuFacts, reqs: Requirements) -> None:
    """Set the torch and bitsandbytes pieces' state from the facts: GPU torch
    is present when a device ran fp16; bitsandbytes when its 4-bit op ran on a
    CUDA device (storyrl's load_in_4bit refuses the CPU)."""
    torch_piece, bnb_piece = _find(reqs, "torch", "cuda"), _find(reqs, "package", "bitsandbytes")
    if torch_piece is not None:
        _, torch_piece.present, torch_piece.where, _ = _torch_line(facts, torch_piece)
    if bnb_piece is not None:
        status, detail, _ = _bnb_line(facts, bnb_piece)
        bnb_piece.present, bnb_piece.where = status == "OK", detail


def _torch_line(facts: GpuFacts, piece: Piece | None) -> tuple[str, bool, str, str]:
    """(status, GPU usable, detail, hint) of torch's line."""
    build = f"torch {facts.build()}"
    if facts.usable:
        names = ", ".join(dict.fromkeys(d.name for d in facts.usable))
        return "OK", True, f"{build}; {len(facts.usable)} usable CUDA device(s): {names}", ""
    hint = TORCH_HINT
    if facts.devices:
        build += ": no device runs fp16 kernels (see the device lines)"
        hint = NO_KERNELS
    elif facts.cuda_error or facts.cuda_build:
        build += f", but CUDA failed: {facts.cuda_error}" if facts.cuda_error else ", but no GPU is visible"
        hint = "a visible GPU: check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES"
    if piece is None:  # nothing named needs a GPU: a CPU build is what a CPU machine should have
        if facts.torch_version is not None and not facts.cuda_build:
            return "OK", False, build + " (nothing named needs a GPU)", ""
        return "WARN", False, build, hint
    if not piece.required:
        return "WARN", False, build + "; models run on the CPU (slower)", hint
    return "MISSING", False, build, hint


def _bnb_line(facts: GpuFacts, piece: Piece | None) -> tuple[str, str, str]:
    """(status, detail, hint) of bitsandbytes' line."""
    bnb = facts.bitsandbytes
    problem = "MISSING" if piece is not None and piece.required else "WARN"
    if bnb.state == "missing":
        return _problem(piece), "not installed", QUANT_HINT
    if bnb.state == "broken":
        return problem, f"import failed: {bnb.error}", REINSTALL_BNB
    backend = "CUDA backend" if bnb.cuda_backend else "no CUDA backend"
    op = f"4-bit op on {bnb.device} works" if bnb.four_bit else f"4-bit op on {bnb.device} failed: {bnb.error}"
    detail = f"{bnb.version}, {backend}; {op}"
    if bnb.four_bit and bnb.device != "cpu":
        return "OK", detail, ""
    if not facts.usable and bnb.four_bit:  # a CPU machine: expected, a problem only for load_in_4bit
        return ("MISSING" if problem == "MISSING" else "OK"), detail + " (load_in_4bit needs a CUDA device)", \
            "a CUDA device (see torch's line)"
    return problem, detail, REINSTALL_BNB


def gpu_lines(facts: GpuFacts, reqs: Requirements) -> list[Line]:
    """torch's line, one per CUDA device, bitsandbytes' line."""
    torch_piece, bnb_piece = _find(reqs, "torch", "cuda"), _find(reqs, "package", "bitsandbytes")
    status, _, detail, hint = _torch_line(facts, torch_piece)
    lines = [Line(status, "torch", detail, hint, torch_piece)]
    for device in facts.devices:
        fp16 = "yes" if device.fp16 else f"failed: {device.fp16_error}"
        detail = (f"{device.total_gib:g} GiB, compute capability {device.capability[0]}.{device.capability[1]}, "
                  f"bf16 {'yes' if device.bf16 else 'no'}, fp16 {fp16}")
        if not device.fp16:  # MISSING only when it leaves a required GPU with no usable device
            missing = torch_piece is not None and torch_piece.required and not facts.usable
            lines.append(Line("MISSING" if missing else "WARN", device.label, detail, NO_KERNELS, torch_piece))
        elif not device.bf16:
            # is_bf16_supported() says yes here (emulation), so storyrl's "auto" may still pick bf16
            lines.append(Line("WARN", device.label, detail.replace("bf16 no", "bf16 no (emulated, slow: use fp16)")))
        else:
            lines.append(Line("OK", device.label, detail))
    status, detail, hint = _bnb_line(facts, bnb_piece)
    lines.append(Line(status, "bitsandbytes", detail, hint if status != "OK" else "", bnb_piece))
    return lines
