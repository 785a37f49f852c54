"""Load a model directory that may hold LoRA adapters instead of weights.

storyrl's trainers write ``final/`` as full weights or, with ``lora.merge:
false``, as peft adapters (``adapter_config.json``) over the model they
started from, which may itself be adapters (SFT -> DPO -> RL). Handing such a
directory to ``AutoModel*.from_pretrained`` is not safe: transformers then
loads the base and attaches the adapters through its own peft integration,
frozen, and every later integration call (``active_adapters``,
``get_adapter_state_dict``, hence saving) demands a peft newer than the one
installed; a trainer that adds its own LoRA on top then trains nothing.

:func:`load_pretrained` resolves the chain itself: it loads the root base
(the only model that gets ``from_pretrained``'s quantisation and device
options), applies each directory's adapters with peft and merges them, so the
caller holds a plain transformers model equal to the policy that was saved.
Its ``name_or_path`` is the directory asked for: adapters trained on top of
it record that directory as their base, so the chain stays loadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ADAPTER_CONFIG", "adapter_base", "check_weight_files", "is_adapter_dir", "load_pretrained",
           "processor_source"]

ADAPTER_CONFIG = "adapter_config.json"
_PROCESSOR_FILES = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
_MAX_DEPTH = 16  # adapters over adapters: a longer chain is a loop in the files


def is_adapter_dir(name: str | Path) -> bool:
    """Whether ``name`` is a local directory of peft adapters."""
    return (Path(name) / ADAPTER_CONFIG).is_file()


def adapter_base(directory: str | Path) -> tuple[str, str | None]:
    """(base model, its revision) that the adapters in ``directory`` were
    trained on. A relative local base is taken relative to the current
    directory, as peft and transformers do."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the adapters' config: {exc}") from None
    base = meta.get("base_model_name_or_path") if isinstance(meta, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: names no base model (base_model_name_or_path); load the adapters on their base "
                         "or save them with it")
    revision = meta.get("revision")
    return base, revision if isinstance(revision, str) and revision else None


def _chain(name: str) -> tuple[list[str], str, str | None]:
    """(adapter directories from the root base outwards, root base, the
    root's revision from the adapters' config)."""
    adapters: list[str] = []
    revision = None
    while is_adapter_dir(name):
        if len(adapters) >= _MAX_DEPTH or name in adapters:
            raise ValueError(f"{adapters[0] if adapters else name}: the adapters' base models form a loop or a chain "
                             f"longer than {_MAX_DEPTH} ({' -> '.join([*adapters, name])})")
        adapters.append(name)
        name, revision = adapter_base(name)
    return adapters[::-1], name, revision


def check_weight_files(directory: str | Path) -> None:
    """ValueError naming the file if a ``*.safetensors`` file in
    ``directory`` (a model directory or a checkpoint; nothing for a hub
    name) has a header that does not parse or does not fit the file
    (transformers' error would name no file)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001  (SafetensorError, OSError: any unreadable file)
            raise ValueError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())}); the file "
                             "is corrupted or cut short: restore it or start again") from None


def load_pretrained(auto_class: Any, name: str, revision: str | None = None, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained(name, revision=revision, **kwargs)``,
    except that a directory of LoRA adapters is loaded as its base with the
    adapters merged in (recursively). ``kwargs`` (dtype, quantisation,
    device map, num_labels, ...) apply to the root base; ``revision`` applies
    to ``name`` when it is the model itself, else the revision the adapters
    recorded is used for their base."""
    adapters, root, recorded = _chain(str(name))
    for directory in [root, *adapters]:
        check_weight_files(directory)
    if not adapters:
        return auto_class.from_pretrained(name, revision=revision, **kwargs)
    from peft import PeftConfig, PeftModel

    model = auto_class.from_pretrained(root, revision=recorded, **kwargs)
    # peft freezes the base it wraps; the merged model trains as loaded.
    trainable = {pname for pname, param in model.named_parameters() if param.requires_grad}
    for directory in adapters:
        try:
            config = PeftConfig.from_pretrained(directory)
            # Merged away at once, so the task's wrapper only gets in the way
            # (a policy's CAUSAL_LM adapters under a reward model's backbone);
            # SEQ_CLS keeps its own: it restores the score head saved whole.
            if config.task_type != "SEQ_CLS":
                config.task_type = None
            model = PeftModel.from_pretrained(model, directory, config=config).merge_and_unload()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"{directory}: cannot load the adapters on {model.name_or_path}: "
                             f"{' '.join(str(exc).split())}") from None
        # Adapters trained on this model next record this directory as their base.
        model.name_or_path = directory
        model.config._name_or_path = directory
    for pname, param in model.named_parameters():
        param.requires_grad_(pname in trainable)
    return model


def processor_source(name: str, revision: str | None = None) -> tuple[str, str | None]:
    """(where, revision) the tokenizer/processor of ``name`` is saved: the
    adapters' directory when they were saved with one (storyrl's trainers
    do), else the nearest base down the chain that has one."""
    current = str(name)
    for _ in range(_MAX_DEPTH + 1):
        if not is_adapter_dir(current) or any((Path(current) / f).is_file() for f in _PROCESSOR_FILES):
            return current, revision
        current, revision = adapter_base(current)
    return current, revision
