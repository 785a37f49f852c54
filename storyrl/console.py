"""What storyrl's commands print: third-party noise hidden unless ``--verbose``,
progress bars that stay readable when stderr is a log file or a pipe.

:func:`configure_output` is the one place the policy lives; the CLI's ``main``
group calls it before any command runs (and before torch, transformers or
open_clip are imported). ``--verbose`` (``STORYRL_VERBOSE=1``, inherited by the
processes a command starts) leaves everything as the libraries print it.

Hidden without ``--verbose``, each matched on what the library really emits:

* ``FutureWarning``/``DeprecationWarning`` (transformers' ``gradient_checkpointing``
  renames, printed at every policy save): advice for developers, not users;
* storyrl's ``TorchvisionOpsFallbackWarning``: the fallback works for every
  command (an op without one fails with its own error);
* the ``transformers``, ``huggingface_hub`` and ``datasets`` loggers below
  error level (their ``*_VERBOSITY`` variables, so a user's own setting wins);
* accelerate's ``Removed shared tensor {...} while saving`` (tied embeddings,
  reloaded correctly by ``from_pretrained``);
* open_clip's ``Ignoring `pretrained=...``` and ``No pretrained weights loaded
  ... initialized randomly``: the first is about a tag open_clip ignores, the
  second follows either ``pretrained: null`` (asked for) or a more specific
  warning that stays (``no CLIP weights found in DIR``);
* the ``datasets`` library's progress bars (``Map:``, ``Filter``, TRL's
  ``Tokenizing train dataset``), on a terminal too (``HF_DATASETS_DISABLE_PROGRESS_BARS``);
* other third-party progress bars (weight loading, shard writing) when stderr is not
  a terminal, where they are only carriage returns and cursor moves in a log.

Log records (storyrl's warnings, a library's) are printed as the message
alone, whatever a library does: ``logging.warning(...)`` called by open_clip
would otherwise ``basicConfig()`` the root logger and turn every later line
into ``WARNING:storyrl.rewards.base:...``.

:func:`progress` is storyrl's own tqdm: on a terminal unchanged; elsewhere one
plain bar updated at most every few seconds, and no nested bars (whose cursor-up
``ESC [A`` codes garble a log).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

__all__ = ["VERBOSE_ENV", "configure_output", "is_tty", "progress", "verbose"]

VERBOSE_ENV = "STORYRL_VERBOSE"

# Non-terminal bars: at most one line every this many seconds (tqdm's default
# 0.1 s fills a log with thousands of carriage-return updates).
PLAIN_MININTERVAL_S = 10.0

DATASETS_BARS_ENV = "HF_DATASETS_DISABLE_PROGRESS_BARS"

_LIBRARY_VERBOSITY = {"transformers": "TRANSFORMERS_VERBOSITY", "huggingface_hub": "HF_HUB_VERBOSITY",
                      "datasets": "DATASETS_VERBOSITY"}

# (logger name, message parts) of log records that are noise for a user.
# open_clip logs through the root logger (logging.warning), accelerate through
# logging.getLogger("accelerate.utils.other") with a "[RANK n] " prefix.
_NOISY_RECORDS = {
    "": ("Ignoring `pretrained=", "No pretrained weights loaded for model "),
    "accelerate.utils.other": ("Removed shared tensor ",),
}


def verbose() -> bool:
    """Whether ``--verbose`` (or ``STORYRL_VERBOSE=1``) asked for everything."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _DropMessages(logging.Filter):
    def __init__(self, parts: tuple[str, ...]) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)  # these libraries log formatted strings: no need to apply args
        return not any(part in message for part in self.parts)


_configured = False


def is_tty(stream: Any = None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def configure_output(verbose_output: bool | None = None) -> bool:
    """Apply the output policy for this process (idempotent); returns whether
    it is quiet. ``verbose_output`` None reads ``STORYRL_VERBOSE``."""
    global _configured
    if verbose_output is None:
        verbose_output = verbose()
    _console_logging()
    if verbose_output or _configured:
        return not verbose_output
    _configured = True
    from storyrl.compat import TorchvisionOpsFallbackWarning

    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning, TorchvisionOpsFallbackWarning):
        warnings.filterwarnings("ignore", category=category)
    for name, parts in _NOISY_RECORDS.items():
        logging.getLogger(name).addFilter(_DropMessages(parts))
    for module, variable in _LIBRARY_VERBOSITY.items():
        os.environ.setdefault(variable, "error")  # read when the library is imported, here and in subprocesses
        if module in sys.modules:  # imported already: its level was set from the environment then
            _set_library_verbosity(module, os.environ[variable])
    # datasets' map/filter bars ("Map:", TRL's "Tokenizing train dataset") on a
    # terminal too: storyrl's own bar is the one progress shown.
    os.environ.setdefault(DATASETS_BARS_ENV, "1")  # read when datasets is imported
    if "datasets" in sys.modules and os.environ[DATASETS_BARS_ENV] == "1":
        from datasets.utils import disable_progress_bars

        disable_progress_bars()
    if not is_tty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's switch
        if "huggingface_hub" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
    return True


class _ConsoleHandler(logging.Handler):
    """What Python's last-resort handler does (the message alone, to
    whatever ``sys.stderr`` is when a record comes), as the root logger's
    handler: a library's ``logging.warning(...)`` then finds a handler and
    does not call ``logging.basicConfig()``, whose ``WARNING:name:message``
    lines would be every later message's format."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 -- logging's own rule: a failed record never raises
            self.handleError(record)


def _console_logging() -> None:
    """storyrl's console format for log records, unless the root logger
    already has a handler (the application's own, or pytest's)."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_ConsoleHandler())


def _set_library_verbosity(module: str, level: str) -> None:
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        return  # the library itself reports an unknown level
    if module == "transformers":
        from transformers.utils import logging as library_logging
    elif module == "huggingface_hub":
        from huggingface_hub.utils import logging as library_logging
    else:
        from datasets.utils import logging as library_logging
    library_logging.set_verbosity(number)


def progress(iterable=None, *, file: Any = None, nested: bool = False, **kwargs: Any):
    """A tqdm bar (``tqdm.auto``) that stays readable when ``file`` (default
    stderr) is not a terminal: there a ``nested`` bar (``position`` > 0, or
    any bar opened while another one is open) is disabled, since each of its
    updates moves the cursor up (``ESC [A``), and the others update at most
    every :data:`PLAIN_MININTERVAL_S` seconds. On a terminal, tqdm as asked."""
    from tqdm.auto import tqdm

    stream = sys.stderr if file is None else file
    if not is_tty(stream):
        inner = nested or bool(kwargs.get("position")) or _bars_open(tqdm)
        if inner:
            kwargs["disable"] = True
        kwargs.pop("position", None)
        kwargs.setdefault("mininterval", PLAIN_MININTERVAL_S)
        kwargs["dynamic_ncols"] = False
    return tqdm(iterable, file=stream, **kwargs)


def _bars_open(tqdm_class) -> bool:
    # tqdm keeps every open, enabled bar in a class-wide WeakSet (shared with
    # its subclasses, so transformers' and TRL's bars count too).
    instances = getattr(tqdm_class, "_instances", ())
    return any(not getattr(bar, "disable", False) for bar in list(instances))
