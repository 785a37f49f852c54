"""Training configuration shared by the learned metrics (RoViST-C, RoViST-VG).

``TrainConfig.from_yaml`` works for subclasses too: the valid keys and their
types come from the dataclass fields of ``cls``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from storyrl.options import check_type, load_yaml

__all__ = ["TrainConfig"]

_MISSING = dataclasses.MISSING


@dataclass
class TrainConfig:
    """Settings of :func:`storyrl.training.loop.fit`."""

    output_dir: str
    epochs: int = 20
    batch_size: int = 32
    lr: float = 1e-5
    weight_decay: float = 1e-5
    lr_decay: float = 0.95  # ExponentialLR gamma, stepped once per epoch
    patience: int = 5  # early stopping: epochs without validation-loss improvement
    val_fraction: float = 0.15
    seed: int = 0
    max_steps: int | None = None  # stop after this many optimizer steps (smoke tests)
    mixed_precision: str = "no"  # accelerate: no | fp16 | bf16
    num_workers: int = 0
    log_every: int = 50

    def __post_init__(self) -> None:
        # Types first (strict, for YAML and Python alike), then values.
        for key, tp in self._field_types().items():
            try:
                setattr(self, key, check_type(getattr(self, key), tp))
            except TypeError as exc:
                raise TypeError(f"{type(self).__name__}: key {key!r}: {exc}") from None
        problems = []
        if self.epochs < 1:
            problems.append(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, got {self.batch_size}")
        if self.patience < 1:
            problems.append(f"patience must be >= 1, got {self.patience}")
        if not 0.0 < self.val_fraction < 1.0:
            problems.append(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps must be >= 1 or null, got {self.max_steps}")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            problems.append(f"mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.num_workers < 0:
            problems.append(f"num_workers must be >= 0, got {self.num_workers}")
        if self.log_every < 1:
            problems.append(f"log_every must be >= 1, got {self.log_every}")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    @classmethod
    def _field_types(cls) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "<mapping>", **overrides: Any):
        """Build from a mapping (e.g. parsed YAML) plus keyword overrides;
        ``None`` overrides are ignored (unset command-line options)."""
        types_ = cls._field_types()
        valid = ", ".join(types_)
        values: dict[str, Any] = {}
        for origin, mapping in ((source, data), (f"{source} (overrides)", overrides)):
            for key, value in mapping.items():
                if mapping is overrides and value is None:
                    continue
                if key not in types_:
                    raise ValueError(f"{origin}: unknown key {key!r} for {cls.__name__}; valid keys: {valid}")
                values[key] = value
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.init and f.name not in values and f.default is _MISSING and f.default_factory is _MISSING
        ]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {', '.join(map(repr, missing))} for {cls.__name__}")
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any):
        """Read a YAML mapping of field values; ``overrides`` (keyword
        arguments, ``None`` = not given) take precedence."""
        path = Path(path)
        data = load_yaml(path)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a YAML mapping of settings, got {type(data).__name__}")
        return cls.from_mapping(data, source=str(path), **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write the settings so that ``from_yaml`` reads them back."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")
