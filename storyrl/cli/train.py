"""Training commands: the ``train`` group, one command per registered trainer
(:data:`storyrl.training.TRAINERS`), with options generated from the
trainer's config dataclass."""

from __future__ import annotations

import click

from storyrl.cli.common import _FILE, _fail, _json
from storyrl.cli.config_options import GeneratedOptionsCommand, config_options, expressible, given
from storyrl.config import option_info


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


class _TrainCommand(GeneratedOptionsCommand):
    """A trainer's command: the help text and the --config/--resume help
    come from its :class:`~storyrl.training.Trainer` entry (output layout,
    config directory), read when shown or parsed, so listing the commands
    imports no trainer."""

    def __init__(self, *args, trainer_params, help_text, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._trainer_params, self._help_text = trainer_params, help_text

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return [*self._trainer_params(), *super().get_params(ctx)]

    # A property, not set in format_help: every reader of ``help`` (--help, mkdocs-click's CLI
    # reference) gets the full text; listing the commands reads only ``short_help``.
    @property
    def help(self) -> str | None:
        help_text = getattr(self, "_help_text", None)
        return help_text() if help_text is not None else self._plain_help

    @help.setter
    def help(self, value: str | None) -> None:
        self._plain_help = value


def _refuse_locked(config_path, overrides: dict) -> None:
    """A second run on the output directory of a running one fails at once:
    checking the config can take seconds (telling a local policy's kind
    imports transformers), the lock is a file. Only a look: the trainer
    takes the lock itself (:func:`storyrl.training.runs.guarded`), and a
    file that cannot be read is left to the config's own error."""
    from pathlib import Path

    from storyrl.config import load_yaml
    from storyrl.training.runs import LOCK_FILE, is_main_process, lock_directory

    output_dir = overrides.get("output_dir")
    if output_dir is None:
        try:
            data = load_yaml(config_path)
        except (OSError, ValueError):
            return
        output_dir = data.get("output_dir") if isinstance(data, dict) else None
    if not isinstance(output_dir, str) or not is_main_process():
        return  # other ranks share the main process's lock
    if (Path(output_dir) / LOCK_FILE).is_file():
        with lock_directory(output_dir):
            pass  # RunDirectoryError (a ValueError) when another run holds it


def _train_command(name: str, description: str) -> click.Command:
    def trainer():
        from storyrl.training import TRAINERS

        return TRAINERS.get(name)

    def options(own: set[str]) -> list[click.Parameter]:
        return config_options(trainer().config_class, own)

    def command(config_path, resume, overwrite, quiet, **values) -> None:
        from storyrl.training import TrainResult
        from storyrl.training.model_card import ensure_model_card

        if resume and overwrite:
            _fail("--resume and --overwrite exclude each other", 2)
        entry = trainer()
        try:
            _refuse_locked(config_path, given(values))
            config = entry.config_class.from_yaml(config_path, **given(values))
            result = entry.run(config, resume=resume, progress=not quiet, overwrite=overwrite)
        except (FileNotFoundError, ValueError) as exc:
            _fail(str(exc))
        if not isinstance(result, TrainResult):
            _fail(f"trainer {name}: its train function returned {type(result).__name__}, which has no summary() "
                  f"(storyrl.training.TrainResult)")
        ensure_model_card(result, config, name)  # the trainers that write no card of their own (PPO, reward model)
        click.echo(_json(result.summary()))

    def help_text() -> str:
        entry = trainer()
        file_only = [f"{info.name}:" for info in option_info(entry.config_class) if not expressible(info)]
        nested = f" (keys only the file sets: {', '.join(file_only)})" if file_only else ""
        return (f"{description} Trains from a config YAML; every top-level config key can also be given as an "
                f"option, which wins over the file{nested}. {entry.outputs}")

    def trainer_params() -> list[click.Parameter]:
        entry = trainer()
        return [click.Option(["--config", "config_path"], required=True, type=_FILE,
                             help=f"Training config YAML ({entry.config_file.format(name=name)})."),
                click.Option(["--resume"], is_flag=True, help=entry.resume_help)]

    params = [
        click.Option(["--overwrite"], is_flag=True,
                     help="Replace an earlier run in OUTPUT_DIR (its files are removed first); without it a run "
                          "refuses a directory that holds files."),
        click.Option(["--quiet", "-q"], is_flag=True, help="No progress bars."),
    ]
    return _TrainCommand(name, params=params, callback=command, short_help=description, generate=options,
                         trainer_params=trainer_params, help_text=help_text)
