"""``storyrl doctor``: the GPU, and the pieces a run needs, present or
missing, and how to get them (the checks and downloads are :mod:`storyrl.doctor`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail, _metric_list

_STATUS = {(True, True): "OK", (True, False): "OK", (False, True): "MISSING", (False, False): "optional"}
# Pieces the GPU lines answer (they are shown there, with the device facts).
_GPU_PIECES = {("torch", "cuda"), ("package", "bitsandbytes")}


def _owners(piece, most: int = 3) -> str:
    owners = piece.needed_by
    return ", ".join(owners[:most]) + (f" +{len(owners) - most}" if len(owners) > most else "")


def _table(gpu_lines, pieces) -> str:
    """The GPU lines, then one row per piece (status, what, where found or why
    missing); under a problem, who needs it and the command or link that gets it."""
    rows = [(line.status, line.label, line.detail) for line in gpu_lines]
    rows += [(_STATUS[(bool(p.present), p.required)], p.label, p.where) for p in pieces]
    widths = [max([len(r[k]) for r in rows], default=0) for k in range(2)]
    indent = " " * (widths[0] + 2)
    lines = []
    for line, row in zip(gpu_lines, rows):
        lines.append(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
        if line.status != "OK" and line.hint:
            owners = f"needed by {_owners(line.piece)}; " if line.piece else ""
            lines.append(f"{indent}{owners}get it: {line.hint}")
    for piece, row in zip(pieces, rows[len(gpu_lines):]):
        lines.append(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
        if not piece.present:
            lines.append(f"{indent}needed by {_owners(piece)}; get it: {piece.hint}")
        if piece.fetch_error:
            lines.append(f"{indent}fetch failed: {piece.fetch_error}")
    return "\n".join(line.rstrip() for line in lines)


@click.command()
@click.option("--metrics", "-m", default=None,
              help="Comma-separated reward names whose pieces to check, e.g. dhm,groovist.")
@click.option("--config", "configs", multiple=True, type=_FILE,
              help="A reward (configs/rewards), RL (configs/rl) or sweep (configs/sweeps) config; repeatable.")
@click.option("--fetch", is_flag=True, help="Download the missing required pieces that can be downloaded (hub "
              "models, spaCy pipelines, storyrl assets), then check again.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object instead of a table.")
def doctor(metrics: str | None, configs: tuple[Path, ...], fetch: bool, as_json: bool) -> None:
    """Report the GPU (torch's build; each CUDA device's name, memory, compute
    capability, bf16, fp16; bitsandbytes and a 4-bit op) and check what the
    named rewards and configs need -- GPU torch, 4-bit, hub models, spaCy
    pipelines, storyrl assets, model directories, data -- or, with nothing
    named, the paper's whole setup. Lookups only: no model is loaded, and
    offline it takes seconds. Exit 0 when every required piece is present, 1
    when one is missing (MISSING; WARN and optional lines never fail it)."""
    from storyrl import doctor as lib

    names = _metric_list(metrics)
    if metrics is not None and not names:  # -m '' or -m ,,, is a slip, not a request for the whole setup
        _fail(f"--metrics: no reward named in {metrics!r}; give names such as dhm,groovist, or leave -m out to "
              "check the paper's whole setup", exit_code=2)
    try:
        reqs = lib.requirements(names, configs)
    except KeyError as exc:  # a reward name the command line got wrong: a usage error
        _fail(f"--metrics: {exc.args[0]}", exit_code=2)
    except (TypeError, ValueError) as exc:
        _fail(" ".join(str(exc).split()))
    gpu = lib.gpu_facts()  # after the config errors: importing torch takes seconds
    if fetch:
        lib.fetch(reqs, report=None if as_json else lambda line: click.echo(line, err=True), gpu=gpu)
    else:
        lib.check(reqs, gpu=gpu)
    missing = reqs.missing()
    gpu_lines = lib.gpu_lines(gpu, reqs)
    if as_json:
        click.echo(json.dumps({"ok": not missing, "missing": [p.label for p in missing],
                               "gpu": {**gpu.to_json(), "lines": [line.to_json() for line in gpu_lines]},
                               "pieces": [p.to_json() for p in reqs.pieces]}))
    else:
        click.echo(_table(gpu_lines, [p for p in reqs.pieces if p.key not in _GPU_PIECES]))
        click.echo(_summary(reqs, fetch))
    if missing:
        click.get_current_context().exit(1)


def _summary(reqs, fetched: bool) -> str:
    missing = reqs.missing()
    required = [p for p in reqs.pieces if p.required]
    if not reqs.pieces:
        return "nothing to check: no model, pipeline, word list or file is needed"
    if not missing:
        return f"all {len(required)} required pieces are present"
    line = f"{len(missing)} of {len(required)} required pieces missing"
    fetchable = [p for p in missing if p.fetchable]
    if fetchable and not fetched:
        line += f"; `storyrl doctor --fetch` downloads {len(fetchable)} of them"
    elif fetchable:
        line += f"; {len(fetchable)} could not be downloaded (see 'fetch failed')"
    return line + "; for the others run the command or open the link shown"
