"""`storyrl launch`: accelerate's launch options, N real processes on the CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import json, os, sys
    from storyrl.training.runs import process_state

    state = process_state()
    with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', 'none')}.json"), "w") as f:
        json.dump({"rank": os.environ.get("RANK"), "world_size": os.environ.get("WORLD_SIZE"),
                   "num_processes": state.num_processes, "process_index": state.process_index,
                   "distributed_type": str(state.distributed_type)}, f)
    if os.environ.get("RANK") == "1" and os.environ.get("PROBE_EXIT_RANK1"):
        import time  # let rank 0 write its file before torchrun stops it
        for _ in range(300):
            if os.path.exists(os.path.join(sys.argv[1], "rank0.json")):
                break
            time.sleep(0.1)
        sys.exit(int(os.environ["PROBE_EXIT_RANK1"]))
""")


def storyrl_launch(tmp_path, *argv, extra_env=None) -> subprocess.CompletedProcess:
    # HF_HOME in tmp_path: no accelerate default config of this machine is read
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "storyrl", "launch", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_storyrl_launch_starts_two_cpu_processes(tmp_path):
    """`storyrl launch --cpu --num_processes 2 -- probe.py` starts two ranks
    that accelerate (via process_state) sees as a 2-process MULTI_CPU run,
    where accelerate's own launcher starts one process."""
    (tmp_path / "probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    result = storyrl_launch(tmp_path, "--cpu", "--num_processes", "2", "--", "probe.py", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    seen = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda s: s["rank"])
    assert [s["rank"] for s in seen] == ["0", "1"]
    assert {s["world_size"] for s in seen} == {"2"}
    assert [s["process_index"] for s in seen] == [0, 1]
    assert {s["num_processes"] for s in seen} == {2}
    assert {s["distributed_type"] for s in seen} == {"DistributedType.MULTI_CPU"}


def test_storyrl_launch_multi_cpu_config_and_failing_rank(tmp_path):
    """A MULTI_CPU config file gives the process count; a rank that fails
    makes the launch fail with its exit code and one error line."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "cpu.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                                       "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\n"
                                       "mixed_precision: 'no'\nuse_cpu: true\n")
    out = tmp_path / "out"
    out.mkdir()
    result = storyrl_launch(tmp_path, "--config_file", "cpu.yaml", "probe.py", str(out),
                            extra_env={"PROBE_EXIT_RANK1": "3"})
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Error: rank 1 of 2 processes failed first (exit code 3)" in result.stderr
    assert sorted(p.name for p in out.glob("rank*.json")) == ["rank0.json", "rank1.json"]


def test_storyrl_launch_runs_storyrl_command_in_each_process(tmp_path):
    """A bare `storyrl` after the options is this Python's storyrl module."""
    result = storyrl_launch(tmp_path, "--cpu", "--num_processes", "2", "--", "storyrl", "--version")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("storyrl, version") == 2
