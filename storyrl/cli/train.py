"""Training commands: the ``train`` group, one command per registered trainer
(:data:`storyrl.training.TRAINERS`), with options generated from the
trainer's config dataclass."""

from __future__ import annotations

import click

from storyrl.cli.common import _FILE, _fail, _json
from storyrl.cli.config_options import GeneratedOptionsCommand, config_options, given


class _TrainerGroup(click.Group):
    """Commands made from the trainer registry on demand; a trainer's module
    (torch, transformers) is imported only when its options are needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from storyrl.training import TRAINERS

        return TRAINERS.names()

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from storyrl.training import TRAINERS

        if name not in TRAINERS:
            return None
        return _train_command(TRAINERS.resolve(name), TRAINERS.describe(name))


@click.group(cls=_TrainerGroup)
def train() -> None:
    """Train the learned metrics (RoViST-C coherence, RoViST-VG) and TAPM-style
    storytellers, and fine-tune storytellers with RL (rl: PPO, GRPO, RLOO).
    Multi-GPU: run under `accelerate launch -m storyrl.cli train ...`
    (configs/accelerate/README.md)."""


# What a trainer leaves in OUTPUT_DIR, where its configs live, what --resume does:
# storyrl.training.loop.fit's layout, or the RL runs' (checkpoint-<step>/ as TRL's).
_FIT_LAYOUT = ("Best model in OUTPUT_DIR/best, resumable state in OUTPUT_DIR/last, one JSON line per epoch in "
               "OUTPUT_DIR/history.jsonl.", "configs/training/{name}.yaml", "Continue from OUTPUT_DIR/last.")
_LAYOUTS = {
    "rl": ("Checkpoints OUTPUT_DIR/checkpoint-<step>, the resolved config OUTPUT_DIR/rl_config.yaml, one JSON line "
           "per logged step in OUTPUT_DIR/history.jsonl and the trained policy in OUTPUT_DIR/final.",
           "configs/rl/<name>.yaml", "Continue from the latest OUTPUT_DIR/checkpoint-<step>."),
}


def _train_command(name: str, description: str) -> click.Command:
    def options(own: set[str]) -> list[click.Parameter]:
        from storyrl.training import TRAINERS

        return config_options(TRAINERS.get(name).config_class, own)

    def command(config_path, resume, overwrite, quiet, **values) -> None:
        from storyrl.training import TRAINERS

        if resume and overwrite:
            _fail("--resume and --overwrite exclude each other", 2)
        trainer = TRAINERS.get(name)
        try:
            config = trainer.config_class.from_yaml(config_path, **given(values))
            result = trainer.run(config, resume=resume, progress=not quiet, overwrite=overwrite)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        summary = getattr(result, "summary", None)  # trainers without epochs (rl) say what they did
        click.echo(_json(summary() if callable(summary) else {
            "output_dir": config.output_dir,
            "best_epoch": result.best_epoch,
            "best_val_loss": result.best_val_loss,
            # What chose best/ when it is not the validation loss (Vrank: val_acc).
            **({result.monitor: result.best_metric} if getattr(result, "monitor", "val_loss") != "val_loss" else {}),
            "epochs_run": result.epochs_run,
            "stopped_early": result.stopped_early,
        }))

    outputs, config_file, resume_help = _LAYOUTS.get(name, _FIT_LAYOUT)
    help_text = (f"{description} Trains from a config YAML; every top-level config key can also be given as an "
                 f"option, which wins over the file (nested mappings such as grpo:, ppo:, rloo:, lora: only in the file). "
                 f"{outputs}")
    params = [
        click.Option(["--config", "config_path"], required=True, type=_FILE,
                     help=f"Training config YAML ({config_file.format(name=name)})."),
        click.Option(["--resume"], is_flag=True, help=resume_help),
        click.Option(["--overwrite"], is_flag=True,
                     help="Replace an earlier run in OUTPUT_DIR (its files are removed first); without it a run "
                          "refuses a directory that holds files."),
        click.Option(["--quiet", "-q"], is_flag=True, help="No progress bars."),
    ]
    return GeneratedOptionsCommand(name, params=params, callback=command, help=help_text,
                                   short_help=description, generate=options)
