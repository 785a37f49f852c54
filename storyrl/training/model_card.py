"""The model card (``README.md``) of a trained storyteller's ``final/``.

TRL writes a card into ``OUTPUT_DIR`` at every checkpoint ("a fine-tuned
version of [None]": it names no base for a local model) and PEFT writes its
template ("[More Information Needed]") beside every saved adapter. storyrl
writes its own card in ``final/`` instead -- the base model, the data, the
rewards, the command, storyrl's version and the date -- and removes the
libraries' cards from ``OUTPUT_DIR`` and its ``checkpoint-<step>/``
directories (these are for ``--resume``, not for publishing): a card says
what is true or nothing.

:func:`write_model_card` writes the card; :func:`remove_library_cards`
removes the others; :func:`library_cards_callback` does that after every
checkpoint a TRL trainer saves, so a killed run leaves none behind;
:func:`ensure_model_card` is what ``storyrl train`` does after any trainer
whose result has a ``final_dir``. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["CARD_FILE", "CARD_MARK", "command_line", "ensure_model_card", "is_storyrl_card", "library_cards_callback",
           "model_card", "remove_library_cards", "write_model_card"]

CARD_FILE = "README.md"
#: The first line after the front matter of every card storyrl writes.
CARD_MARK = "<!-- model card written by storyrl -->"

# What each trainer's card calls its rewards: RL trains on them, DPO only
# scores its monitoring samples with them.
_REWARD_ROLES = {"rl": "rewards", "dpo": "monitoring rewards"}
_WHAT = {"reward_model": "A story reward model (for the `reward_model` reward)"}


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process: ``storyrl ...`` for the
    command line (the console script, ``python -m storyrl`` or
    ``storyrl.cli``, also under ``accelerate launch``), else the Python
    call."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "(unknown)"
    program = Path(argv[0])
    if program.name == "storyrl" or (program.name == "__main__.py" and "storyrl" in program.parts):
        return shlex.join(["storyrl", *argv[1:]])
    return shlex.join([Path(sys.executable).name, *argv])


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("storyrl")
    except PackageNotFoundError:
        return "unknown"


def _cell(value: Any) -> str:
    """A table cell: code, with the characters a Markdown table cell cannot hold replaced."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    text = " ".join(text.split()).replace("|", "\\|").replace("`", "'")
    return f"`{text}`"


def _is_local(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _rows(config: Any, trainer: str, steps: int | None, command: str, weights: str) -> list[tuple[str, str]]:
    model, revision = getattr(config, "model", None), getattr(config, "revision", None)
    rows = [("trainer", _cell(f"storyrl train {trainer}") + (f", algorithm {_cell(config.algorithm)}"
                                                           if getattr(config, "algorithm", None) else ""))]
    if model is not None:
        rows.append(("base model", _cell(model) + (f" at revision {_cell(revision)}" if revision else "")))
    rows.append(("weights", weights))
    data = getattr(config, "data", None)
    if data is not None:
        parts = [_cell(data)]
        if getattr(config, "data_format", None) not in (None, "auto"):
            parts.append(f"format {_cell(config.data_format)}")
        if getattr(config, "image_root", None):
            parts.append(f"images in {_cell(config.image_root)}")
        rows.append(("data", ", ".join(parts)))
    if getattr(config, "pairs", None):
        rows.append(("preference pairs", _cell(config.pairs)))
    rewards = list(getattr(config, "rewards", None) or [])
    if rewards:
        weights_given = getattr(config, "reward_weights", None)
        listed = [_cell(r) + (f" × {w:g}" if weights_given else "")
                  for r, w in zip(rewards, weights_given or [None] * len(rewards))]
        rows.append((_REWARD_ROLES.get(trainer, "rewards"), ", ".join(listed)))
    if getattr(config, "prompt", None):
        rows.append(("prompt", _cell(config.prompt)))
    if steps is not None:
        rows.append(("optimisation steps", str(steps)))
    rows += [("command", _cell(command)), ("storyrl", _cell(_version())),
             ("date", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))]
    return rows


def _weights(directory: Path, config: Any) -> tuple[str, str]:
    """(library, description) of the weights saved in ``directory``."""
    lora = getattr(config, "lora", None)
    if (directory / "adapter_config.json").is_file():
        detail = f" (rank {lora.r}, alpha {lora.alpha})" if lora is not None else ""
        return "peft", f"LoRA adapters{detail} on the base model"
    if lora is not None and lora.enabled:
        return "transformers", "full weights: the base model with its trained LoRA adapters merged in"
    return "transformers", "full weights"


def model_card(directory: str | os.PathLike, config: Any, trainer: str, steps: int | None = None,
               command: str | None = None) -> str:
    """The card of the model saved in ``directory`` by a ``trainer`` run
    (``sft``, ``dpo``, ``rl``, ``reward_model``) with ``config``."""
    import yaml

    directory = Path(directory)
    library, weights = _weights(directory, config)
    model = getattr(config, "model", None)
    front: dict[str, Any] = {"library_name": library}
    if model and not _is_local(model):  # the hub's base_model names a hub model, not a local path
        front["base_model"] = model
    front["tags"] = ["storyrl", "visual-storytelling", trainer]
    rows = _rows(config, trainer, steps, command or command_line(), weights)
    config_files = sorted(p.name for p in directory.glob("*_config.yaml"))
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip("\n"), "---", CARD_MARK, "",
             f"# {directory.resolve().parent.name}/{directory.name}", "",
             f"{_WHAT.get(trainer, 'A storyteller')} trained with storyrl (`storyrl train {trainer}`).", "",
             "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    if config_files:
        lines += [f"The run's whole config is {', '.join(f'`{n}`' for n in config_files)} beside this file.", ""]
    return "\n".join(lines)


def write_model_card(directory: str | os.PathLike, config: Any, trainer: str, steps: int | None = None,
                     command: str | None = None) -> Path:
    """Write :func:`model_card` as ``directory/README.md`` (replacing the
    card a library wrote there); returns its path."""
    path = Path(directory) / CARD_FILE
    text = model_card(directory, config, trainer, steps=steps, command=command)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return path


def is_storyrl_card(path: str | os.PathLike) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return CARD_MARK in handle.read(4096)
    except OSError:
        return False


def remove_library_cards(output_dir: str | os.PathLike) -> list[Path]:
    """Remove the cards TRL and PEFT wrote into ``output_dir`` and its
    ``checkpoint-<step>/`` directories (module docs); storyrl's stay.
    Returns what was removed."""
    output_dir = Path(output_dir)
    removed = []
    for path in [output_dir / CARD_FILE, *sorted(output_dir.glob(f"checkpoint-*/{CARD_FILE}"))]:
        if path.is_file() and not is_storyrl_card(path):
            path.unlink()
            removed.append(path)
    return removed


def library_cards_callback() -> Any:
    """A transformers ``TrainerCallback`` that runs :func:`remove_library_cards`
    after every checkpoint (on the main process)."""
    from transformers import TrainerCallback

    class NoLibraryCards(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                remove_library_cards(args.output_dir)

    return NoLibraryCards()


def ensure_model_card(result: Any, config: Any, trainer: str) -> Path | None:
    """After a run: storyrl's card in the result's ``final_dir`` (when it
    has one and no storyrl card is there yet) and no library cards in its
    output directory. Only the main process writes."""
    from storyrl.training.runs import is_main_process

    final = getattr(result, "final_dir", None)
    if final is None or not Path(final).is_dir() or not is_main_process():
        return None
    if getattr(config, "output_dir", None):
        remove_library_cards(config.output_dir)
    path = Path(final) / CARD_FILE
    if is_storyrl_card(path):
        return path
    return write_model_card(final, config, trainer, steps=getattr(result, "steps", None))
