"""``storyrl launch``: ``accelerate launch`` that works on CPU-only installs.

Two things break the plain ``accelerate`` command there: it imports
``accelerate.commands.estimate`` (timm, then a CUDA torchvision build) before
storyrl's torchvision fallback can be installed, and a ``MULTI_CPU`` config or
``--cpu --num_processes N`` goes to accelerate's "simple" launcher, which
starts exactly one process unless it is given ``--mpirun_hostfile`` (then
``mpirun`` starts them). This command imports storyrl first (installing the
fallback), parses accelerate's own launch options, and

* for several processes on the CPU (``--cpu``, a ``MULTI_CPU``/``use_cpu``
  config, or no CUDA) on one machine without ``--mpirun_hostfile``: starts them
  with ``torch.distributed.run`` (torchrun) and accelerate's CPU environment,
  so ``PartialState``/``Accelerator`` see N ranks over gloo;
* otherwise: hands the parsed options to accelerate's ``launch_command``.

A bare ``storyrl`` as the script means the ``storyrl`` module (``-m storyrl``)
of this interpreter.
"""

from __future__ import annotations

import os

import click

from storyrl.cli.common import CommandError

TORCHRUN_FORM = "python -m torch.distributed.run --standalone --nproc_per_node N -m storyrl ..."


def _split(argv: list[str]) -> list[str]:
    """``OPTIONS -- COMMAND...`` or ``OPTIONS COMMAND...`` as one argv for
    accelerate's parser (which takes everything after the script as the
    script's arguments)."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at] + argv[at + 1:]
    return argv


def _load_defaults(config_file: str | None):
    from accelerate.commands.config import default_config_file
    from accelerate.commands.config.config_args import load_config_from_file

    if config_file is None and not os.path.isfile(default_config_file):
        return None
    return load_config_from_file(config_file)


def _cpu_processes(args, defaults) -> int:
    """The number of CPU processes to start with torchrun, or 0 when
    accelerate's own launcher should run (one process, GPUs, mpirun, several
    machines)."""
    import torch

    num_processes = args.num_processes or (defaults.num_processes if defaults is not None else None) or 1
    if num_processes <= 1 or args.mpirun_hostfile is not None:
        return 0
    on_cpu = args.cpu or not torch.cuda.is_available()
    if defaults is not None:  # DistributedType is a str enum: compare its value, not str() ("DistributedType.X")
        on_cpu = on_cpu or bool(getattr(defaults, "use_cpu", False)) or defaults.distributed_type == "MULTI_CPU"
    if not on_cpu:
        return 0
    num_machines = args.num_machines or (defaults.num_machines if defaults is not None else None) or 1
    if num_machines > 1:
        raise CommandError(f"storyrl launch starts CPU processes on one machine only; on each of the {num_machines} "
                           f"machines run `{TORCHRUN_FORM}` with --nnodes/--node_rank/--rdzv_endpoint, or give "
                           "accelerate's --mpirun_hostfile")
    return num_processes


def _torchrun(args, defaults, num_processes: int) -> None:
    from torch.distributed import run as distrib_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = ["--nnodes", "1", "--nproc_per_node", str(num_processes)]
    port = args.main_process_port if args.main_process_port is not None else (
        getattr(defaults, "main_process_port", None) if defaults is not None else None)
    argv += ["--master_port", str(port)] if port else ["--standalone"]
    if args.module:
        argv.append("-m")
    elif args.no_python:
        argv.append("--no-python")
    argv += [args.training_script, *args.training_script_args]

    mixed_precision = args.mixed_precision or (getattr(defaults, "mixed_precision", None) if defaults else None)
    env = {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": str(mixed_precision or "no").lower()}
    if args.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    threads = args.num_cpu_threads_per_process
    if threads or "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads or 1)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        distrib_run.run(distrib_run.parse_args(argv))
    except ChildFailedError as exc:
        # the first to fail; torchrun then stops the others (negative exit codes: signals), which count
        # as failed too and may carry the same timestamp
        exited = {rank: failure for rank, failure in exc.failures.items() if (failure.exitcode or 0) > 0}
        if exited:
            rank = min(exited, key=lambda r: (exited[r].timestamp, r))
            first = exited[rank]
        else:
            rank, first = exc.get_first_failure()
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        raise CommandError(f"rank {rank} of {num_processes} processes failed first (exit code {code}); "
                           "see its output above", exit_code=code) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                 "help_option_names": ["--launch-help"]})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def launch(argv: tuple[str, ...]) -> None:
    """Run SCRIPT (a .py file, `-m MODULE` or `storyrl ...`) in N processes,
    with `accelerate launch`'s options.

    \b
      storyrl launch --cpu --num_processes 2 -- storyrl train rl --config C.yaml
      storyrl launch --config_file configs/accelerate/multi_gpu.yaml -m storyrl train rl --config C.yaml

    On the CPU (or with no CUDA) N > 1 processes are started with torchrun
    (`python -m torch.distributed.run --standalone --nproc_per_node N ...`),
    since accelerate's own CPU launcher starts one without mpirun; anything
    else goes to accelerate's launcher. `storyrl launch -h` lists
    accelerate's options; this text is `--launch-help`.
    """
    from storyrl.compat import install_torchvision_hook

    install_torchvision_hook()  # before accelerate's imports can reach timm and torchvision (import storyrl did too)
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    parser.prog = "storyrl launch"
    argv = _split(list(argv))
    if not argv:
        raise click.UsageError("give a script: storyrl launch [ACCELERATE OPTIONS] -- storyrl train ...")
    args = parser.parse_args(argv)  # -h/--help: accelerate's option list, exit 0
    if (args.training_script == "storyrl" and not args.module and not args.no_python
            and not os.path.isfile(args.training_script)):
        args.module = True
    defaults = _load_defaults(args.config_file)
    num_processes = _cpu_processes(args, defaults)
    if num_processes:
        _torchrun(args, defaults, num_processes)
        return
    import subprocess

    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:
        raise CommandError(f"the launched command exited with code {exc.returncode}",
                           exit_code=exc.returncode if exc.returncode > 0 else 1) from None
