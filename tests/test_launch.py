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


# -- the launch decisions, in process (no processes started) ----------------------

def _parsed(*argv):
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args(list(argv))


def _defaults(tmp_path, text):
    from storyrl.cli.launch import _load_defaults

    (tmp_path / "c.yaml").write_text("compute_environment: LOCAL_MACHINE\nnum_machines: 1\nmachine_rank: 0\n"
                                     "mixed_precision: 'no'\n" + text)
    return _load_defaults(str(tmp_path / "c.yaml"))


def test_cpu_process_count_from_options_config_and_cuda(tmp_path, monkeypatch):
    import torch

    from storyrl.cli.launch import _cpu_processes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a hand-written MULTI_CPU config without use_cpu, CUDA present: still N CPU processes
    multi_cpu = _defaults(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 3\n")
    assert _cpu_processes(_parsed("x.py"), multi_cpu) == 3
    multi_gpu = _defaults(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert _cpu_processes(_parsed("x.py"), multi_gpu) == 0  # accelerate's launcher
    assert _cpu_processes(_parsed("--cpu", "--num_processes", "2", "x.py"), None) == 2
    assert _cpu_processes(_parsed("--num_processes", "2", "x.py"), None) == 0
    assert _cpu_processes(_parsed("--cpu", "--num_processes", "1", "x.py"), None) == 0
    assert _cpu_processes(_parsed("--cpu", "--num_processes", "2", "--mpirun_hostfile", "h", "x.py"), None) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _cpu_processes(_parsed("--num_processes", "2", "x.py"), None) == 2  # no CUDA means the CPU


def _torchrun_call(monkeypatch, args, defaults=None, n=2, env=None):
    from torch.distributed import run as distrib_run

    from storyrl.cli.launch import _torchrun

    for name in ("OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    seen = {}

    def run(parsed):
        seen["args"] = parsed
        seen["env"] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "ACCELERATE_USE_CPU",
                                                      "ACCELERATE_MIXED_PRECISION")}

    monkeypatch.setattr(distrib_run, "run", run)
    _torchrun(args, defaults, n)
    return seen


def test_torchrun_gets_the_port_threads_and_cpu_environment(tmp_path, monkeypatch):
    seen = _torchrun_call(monkeypatch, _parsed("--cpu", "--num_processes", "2", "--main_process_port", "29633",
                                               "--mixed_precision", "bf16", "x.py", "a"))
    args = seen["args"]
    assert args.master_port == 29633 and not args.standalone and args.nproc_per_node == "2"
    assert [args.training_script, *args.training_script_args] == ["x.py", "a"]
    assert seen["env"] == {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert "ACCELERATE_USE_CPU" not in os.environ and "OMP_NUM_THREADS" not in os.environ  # restored
    # the config's port; a user's own OMP_NUM_THREADS is kept unless threads are given
    config = _defaults(tmp_path, "distributed_type: MULTI_CPU\nnum_processes: 2\nmain_process_port: 29700\n")
    seen = _torchrun_call(monkeypatch, _parsed("x.py"), config, env={"OMP_NUM_THREADS": "4"})
    assert seen["args"].master_port == 29700 and seen["env"]["OMP_NUM_THREADS"] == "4"
    seen = _torchrun_call(monkeypatch, _parsed("--num_cpu_threads_per_process", "3", "x.py"), env={"OMP_NUM_THREADS": "4"})
    assert seen["args"].standalone and seen["env"]["OMP_NUM_THREADS"] == "3"


def test_the_rank_that_exited_first_is_reported_not_one_stopped_by_a_signal(monkeypatch):
    import pytest
    from torch.distributed import run as distrib_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from storyrl.cli.common import CommandError
    from storyrl.cli.launch import _torchrun

    def failure(rank, code, timestamp):
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        f.timestamp = timestamp
        return f

    def run(_parsed):  # rank 0 stopped by SIGTERM (earliest timestamp), rank 1 exited with 5
        raise ChildFailedError("x.py", {0: failure(0, -15, 10), 1: failure(1, 5, 20)})

    monkeypatch.setattr(distrib_run, "run", run)
    with pytest.raises(CommandError) as info:
        _torchrun(_parsed("--cpu", "--num_processes", "2", "x.py"), None, 2)
    assert info.value.exit_code == 5 and "rank 1 of 2 processes failed first (exit code 5)" in info.value.message


def test_accelerates_launcher_passes_the_childs_exit_code_on(monkeypatch, tmp_path):
    import subprocess as sp

    import torch
    from accelerate.commands import launch as accelerate_launch
    from click.testing import CliRunner

    from storyrl.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def launch_command(args):
        raise sp.CalledProcessError(3, ["python", args.training_script])

    monkeypatch.setattr(accelerate_launch, "launch_command", launch_command)
    result = CliRunner().invoke(main, ["launch", "--num_processes", "1", "--", "x.py"])
    assert result.exit_code == 3 and "exited with code 3" in result.output
