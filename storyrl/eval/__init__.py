"""Evaluation: d_HM distances, score tables, meta-evaluation, prompting sweeps,
reward ablations.

The public names load on first use (PEP 562): sweeps and ablations import the
generators and trainers, which ``import storyrl.eval`` must not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Eager, and light (numpy and storyrl.data): importing the submodule binds the
# package attribute ``dhm`` to the module, and this line binds it back to the
# function, once and before anyone can look; left lazy, a later ``import
# storyrl.eval.dhm`` would leave ``from storyrl.eval import dhm`` the module.
from storyrl.eval.dhm import DHM_DIMENSIONS, DhmResult, dhm

#: public name -> the submodule that defines it
_EXPORTS = {
    "AblationConfig": "ablation",
    "AblationResult": "ablation",
    "run_ablation": "ablation",
    "OriginalVsRandom": "grounding",
    "original_vs_random": "grounding",
    "score_to_file": "scoring",
    "SweepConfig": "sweep",
    "SweepResult": "sweep",
    "run_sweep": "sweep",
}

__all__ = [
    "DHM_DIMENSIONS",
    "AblationConfig",
    "AblationResult",
    "DhmResult",
    "OriginalVsRandom",
    "SweepConfig",
    "SweepResult",
    "dhm",
    "original_vs_random",
    "run_ablation",
    "run_sweep",
    "score_to_file",
]

if TYPE_CHECKING:
    from storyrl.eval.ablation import AblationConfig, AblationResult, run_ablation
    from storyrl.eval.grounding import OriginalVsRandom, original_vs_random
    from storyrl.eval.scoring import score_to_file
    from storyrl.eval.sweep import SweepConfig, SweepResult, run_sweep


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
