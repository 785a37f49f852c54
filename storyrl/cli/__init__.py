"""The ``storyrl`` command line: a thin layer over the library.

This module holds the ``main`` group (one-line errors, exit 130 on Ctrl-C,
``--debug``, ``--verbose``, ``--version``) and registers the commands of its modules:
``score`` (score, groovist-calibrate, rewards), ``eval`` (dhm), ``data``
(regions, assets), ``train`` (one command per registered trainer) and
``launch`` (multi-process runs, also on the CPU) and ``doctor`` (what a real
run needs: present, missing, fetched); their shared helpers are
in ``common``, the options generated from config dataclasses in
``config_options`` and the reward-specific parts in ``reward_options``.

Heavy libraries are imported inside the commands that need them, so
``storyrl --help`` and model-free scoring start fast.
"""

from __future__ import annotations

import os

import click

from storyrl.cli.ablate import ablate
from storyrl.cli.common import CommandError
from storyrl.cli.compare import compare
from storyrl.cli.data import assets, regions
from storyrl.cli.doctor import doctor
from storyrl.cli.eval import dhm
from storyrl.cli.features import features
from storyrl.cli.generate import generate
from storyrl.cli.kl import kl
from storyrl.cli.launch import launch
from storyrl.cli.meta_eval import meta_eval
from storyrl.cli.pairs import pairs_cmd
from storyrl.cli.records import records
from storyrl.cli.score import groovist_calibrate, list_rewards_cmd, score
from storyrl.cli.serve import serve
from storyrl.cli.sweep import sweep
from storyrl.cli.train import train
from storyrl.console import VERBOSE_ENV, configure_output

__all__ = ["CommandError", "describe_error", "main"]


def _debug() -> bool:
    return os.environ.get("STORYRL_DEBUG", "") not in ("", "0")


# Errors whose message already says which file, record, reward or option is at
# fault; anything else is shown with its type.
_EXPECTED_ERRORS = ("StoryDataError", "OutputError", "RewardError", "ConfigFileError", "ImageError",
                    "PipelineNotInstalled")


def describe_error(exc: BaseException) -> str:
    """One line for an exception: the file and the fault for OS errors, the
    message for storyrl's own errors, type and message otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        message = f"{where}{exc.strerror}"
    else:
        message = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (OSError, ValueError, KeyError)) and type(exc).__name__ not in _EXPECTED_ERRORS:
        message = f"{type(exc).__name__}: {message}"
    return message


class _Group(click.Group):
    """Turns every error of a command into one line on stderr and a non-zero
    exit (130 for Ctrl-C); ``STORYRL_DEBUG=1`` or ``--debug`` adds the
    traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CommandError as exc:
            # A command's own one-line error raised while handling an exception
            # (``except ValueError as exc: _fail(str(exc))``): that exception's
            # traceback is what --debug promises.
            cause = exc.__cause__ or exc.__context__
            if _debug() and isinstance(cause, BaseException) and not isinstance(cause, click.ClickException):
                import traceback

                traceback.print_exception(cause)
            raise
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            if _debug():
                import traceback

                traceback.print_exc()
            if isinstance(exc, KeyboardInterrupt):
                raise CommandError("interrupted", exit_code=130) from None
            raise CommandError(describe_error(exc)) from exc


def _set_debug(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        os.environ["STORYRL_DEBUG"] = "1"  # also for the subprocesses a command starts
    return value


def _set_verbose(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        os.environ[VERBOSE_ENV] = "1"  # also for the subprocesses a command starts
    return value


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="storyrl")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show tracebacks (same as STORYRL_DEBUG=1).")
@click.option("--verbose", is_flag=True, expose_value=False, is_eager=True, callback=_set_verbose,
              help="Show everything the libraries print: their deprecation warnings, per-step training "
                   "metrics, progress bars in logs (same as STORYRL_VERBOSE=1).")
def main() -> None:
    """storyrl: visual-storytelling metrics as rewards, scores and d_HM tables."""
    configure_output()  # before any command imports torch, transformers or open_clip


for _command in (list_rewards_cmd, score, dhm, groovist_calibrate, regions, assets, train, generate, features, sweep):
    main.add_command(_command)
main.add_command(ablate)
main.add_command(serve)
main.add_command(meta_eval)
main.add_command(launch)
main.add_command(doctor)
main.add_command(pairs_cmd)
main.add_command(records)
main.add_command(kl)
main.add_command(compare)
