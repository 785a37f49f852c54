"""Released verl and OpenRLHF code for the integration tests.

Neither framework can live in storyrl's environment (verl pins
transformers < 5.11; OpenRLHF needs flash-attn and DeepSpeed), so the tests
install the released wheels *without their dependencies* into a cache
directory, next to the few packages their reward path imports (Ray,
tensordict, Hydra/OmegaConf, aiohttp...), and run the frameworks' own
reward-loading and reward-calling code in a subprocess whose path puts that
directory after storyrl's environment. Versions are pinned below; README's
integration section lists them.

The cache is ``$STORYRL_FRAMEWORKS_DIR`` or ``~/.cache/storyrl/frameworks``.
Without network the tests are skipped, except under CI (``CI`` set), where
they fail.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = Path(__file__).resolve().parent / "framework_checks"

VERL_VERSIONS = ("0.6.1", "0.8.0", "0.9.1")
OPENRLHF_VERSIONS = ("0.8.3", "0.10.2", "0.11.2")

# What the reward paths import beyond storyrl's own dependencies.
RUNTIME = (
    "ray==2.55.0", "tensordict==0.10.0", "pyvers==0.2.3", "omegaconf==2.4.0", "hydra_core==1.3.8",
    "antlr4_python3_runtime==4.9.3", "codetiming==1.4.0", "aiohttp==3.14.5", "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0", "frozenlist==1.8.0", "multidict==7.2.1", "yarl==1.25.1", "propcache==0.5.4",
    "msgpack==1.2.4", "protobuf==7.36.2", "jsonschema==4.26.0", "jsonschema_specifications==2025.9.1",
    "referencing==0.37.0", "rpds_py==2026.9.1", "attrs==26.1.0", "orjson==3.13.0", "pylatexenc==2.10",
)


def cache_dir() -> Path:
    return Path(os.environ.get("STORYRL_FRAMEWORKS_DIR") or Path.home() / ".cache" / "storyrl" / "frameworks")


def installed(name: str, packages: tuple[str, ...]) -> Path:
    """``packages`` installed (no dependencies) in their own cache
    directory, once; skips (fails under CI) when pip cannot get them."""
    target = cache_dir() / name
    done = target / ".complete"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            run = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                 "--target", str(target), *packages], check=False, capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                message = f"cannot install {' '.join(packages)}: {run.stderr.strip()[-400:]}"
                if os.environ.get("CI"):
                    pytest.fail(message)
                pytest.skip(message)
            done.write_text(" ".join(packages))
    return target


def framework_path(framework: str, version: str) -> list[Path]:
    """The path entries for ``framework`` at ``version``: the wheel, then the runtime packages."""
    return [installed(f"{framework}-{version}", (f"{framework}=={version}",)), installed("runtime", RUNTIME)]


def run_check(script: str, job: dict, path: list[Path], env: dict | None = None, timeout: float = 300,
              capture_stderr: bool = False) -> dict:
    """Run ``framework_checks/<script>`` with ``job`` (JSON on stdin) in a
    Python whose path ends with ``path``; returns the JSON it prints (with
    ``capture_stderr``, its stderr under ``"stderr"``)."""
    environment = dict(os.environ)
    environment.update(env or {})
    environment.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
    # Appended, not PYTHONPATH: storyrl's environment wins where both have a package.
    boot = (f"import runpy, sys; sys.path.extend({[str(p) for p in path]!r}); "
            f"runpy.run_path({str(CHECKS / script)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", boot], input=json.dumps(job), cwd=ROOT, check=False,
                         capture_output=True, text=True, timeout=timeout, env=environment)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, f"{script} failed ({run.returncode}):\n{run.stderr[-3000:]}"
    result = json.loads(lines[-1])
    if capture_stderr:
        result["stderr"] = run.stderr
    return result
