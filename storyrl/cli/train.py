"""Training commands: the ``train`` group with one command per learned metric
(``train coherence``, ``train rovist-vg``), each over its trainer module."""

from __future__ import annotations

from pathlib import Path

import click

from storyrl.cli.common import _FILE, _fail, _json


@click.group()
def train() -> None:
    """Train the learned metrics (RoViST-C coherence, RoViST-VG). Multi-GPU:
    run under `accelerate launch -m storyrl.cli train ...`."""


# command -> (module, config class, train function); the module is imported
# only when its command runs (it imports torch and transformers).
_TRAINERS = {
    "coherence": ("storyrl.training.coherence", "CoherenceTrainConfig", "train_coherence"),
    "rovist-vg": ("storyrl.training.rovist_vg", "RovistVGTrainConfig", "train_rovist_vg"),
}


def _train_command(kind: str):
    module_name, config_class, function = _TRAINERS[kind]

    @train.command(kind, help=f"Train the {kind} model from a config YAML: best model in OUTPUT_DIR/best, "
                   "resumable state in OUTPUT_DIR/last, one JSON line per epoch in OUTPUT_DIR/history.jsonl.")
    @click.option("--config", "config_path", required=True, type=_FILE, help=f"Training config YAML (configs/training/{kind.replace('-', '_')}.yaml).")
    @click.option("--output-dir", type=click.Path(file_okay=False, path_type=Path), help="Overrides the config's output_dir.")
    @click.option("--resume", is_flag=True, help="Continue from OUTPUT_DIR/last.")
    @click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
    @click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
    def command(config_path, output_dir, resume, max_steps, quiet) -> None:
        import importlib

        module = importlib.import_module(module_name)
        try:
            config = getattr(module, config_class).from_yaml(
                config_path, output_dir=str(output_dir) if output_dir else None, max_steps=max_steps
            )
            result = getattr(module, function)(config, resume=resume, progress=not quiet)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        click.echo(_json({
            "output_dir": config.output_dir,
            "best_epoch": result.best_epoch,
            "best_val_loss": result.best_val_loss,
            "epochs_run": result.epochs_run,
            "stopped_early": result.stopped_early,
        }))

    return command


for _kind in _TRAINERS:
    _train_command(_kind)
