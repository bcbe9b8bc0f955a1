"""Logging, error reporting and flag types shared by the command-line tools.

Library code only logs; a CLI's `main()` wraps its run in `cli_logging()` so that
messages go to stderr as `LEVEL: message` for that call alone, and reports any
error with `one_line_error()`: one line, no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import sys
import threading
from typing import Any, Callable, Iterator

from metaseq.errors import UserError, one_line_error

__all__ = [
    "OneLineErrorParser", "add_bool_flag", "cli_logging", "non_negative_float", "non_negative_int", "one_line_error",
    "REMOVED", "Terminated", "handlers_restored", "ignore_stops", "parse_bool", "positive_float", "positive_int",
    "run_cli", "sigterm_raises", "stop_status",
]

TRUE_WORDS = {"true", "1", "yes", "y", "on"}
FALSE_WORDS = {"false", "0", "no", "n", "off"}


class OneLineErrorParser(argparse.ArgumentParser):
    """Argument errors become one-line UserErrors, reported by `main()` like any other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see --help)")


@contextlib.contextmanager
def cli_logging(level: int = logging.INFO) -> Iterator[logging.Logger]:
    """Send the `metaseq` loggers to stderr at `level` while the block runs, then restore them."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    package_logger = logging.getLogger("metaseq")
    saved = (package_logger.level, package_logger.propagate)
    package_logger.addHandler(handler)
    package_logger.setLevel(level)
    package_logger.propagate = False
    try:
        yield package_logger
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(saved[0])
        package_logger.propagate = saved[1]


REMOVED = "; any outputs of this run were removed"  # `run_cli`'s `stopped` for tools that write


class Terminated(SystemExit):
    """SIGTERM (e.g. a launcher stopping the other ranks) as an exception: `with` blocks and `except BaseException`
    clean-ups (temp files, partial outputs) run on the way out, as for Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(2)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises `Terminated` (in the main thread, where Python takes signals; elsewhere
    this does nothing). Processes forked inside it inherit the handler: reset it there if they must die as usual."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if _in_main_thread() else None
    try:
        yield
    finally:
        if previous is not None:  # None also for a handler not set from Python: left as it is
            signal.signal(signal.SIGTERM, previous)


def run_cli(
    logger: logging.Logger,
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    action: Callable[[argparse.Namespace], int | None],
    *,
    level: int = logging.INFO,
    stopped: str = "",
) -> int:
    """A CLI's `main()`: parse `argv`, run `action(args)` under `cli_logging(level)` (warnings
    only when the parser has `--quiet` and it is given) and return its exit status (None: 0),
    or 2 after reporting any error through `logger` as one line, without a traceback. SIGTERM
    (exit 2) and Ctrl-C (exit 130) are one line too, `stopped` appended (e.g. REMOVED)."""
    with handlers_restored(), cli_logging(level) as package_logger, sigterm_raises():
        try:
            args = parser.parse_args(argv)
            if getattr(args, "quiet", False):
                package_logger.setLevel(logging.WARNING)
            status = action(args)
            return 0 if status is None else status
        except Exception as err:  # noqa: BLE001 -- any error: one line, no traceback
            logger.error("%s", one_line_error(err))
            return 2
        except (Terminated, KeyboardInterrupt) as stop:
            return stop_status(logger, stop, stopped)


def stop_status(logger: logging.Logger, stop: BaseException, stopped: str = "") -> int:
    """Report a Ctrl-C (KeyboardInterrupt) or SIGTERM (`Terminated`) as one line, `stopped` appended; returns the
    exit status, 130 or 2. Further signals are ignored from here (see `ignore_stops`)."""
    ignore_stops()
    terminated = isinstance(stop, Terminated)
    logger.error("%s%s", "terminated by SIGTERM" if terminated else "interrupted", stopped)
    return 2 if terminated else 130


def ignore_stops() -> None:
    """Ignore SIGINT and SIGTERM from now on (in the main thread: elsewhere nothing): for a run that is stopping,
    where another signal would print a traceback. `handlers_restored` (run_cli) puts the handlers back."""
    for signum in (signal.SIGINT, signal.SIGTERM) if _in_main_thread() else ():
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def handlers_restored() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers as they were when the block started, put back when it ends (a `main()` run
    in-process, by a test or a notebook, leaves them as it found them)."""
    saved = [(s, signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)] if _in_main_thread() else []
    try:
        yield
    finally:
        for signum, handler in saved:
            if handler is not None:  # None: not set from Python, which cannot be put back
                signal.signal(signum, handler)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def parse_bool(text: str) -> bool:
    """`True`/`False` in the spellings people use (true/false, 1/0, yes/no, on/off)."""
    word = text.strip().lower()
    if word in TRUE_WORDS | FALSE_WORDS:
        return word in TRUE_WORDS
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def add_bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """`--name`, `--name True/False` and `--no-name`, as metaseq's scripts take them."""
    dest = name.replace("-", "_")
    parser.add_argument(
        f"--{name}", dest=dest, nargs="?", const=True, default=False, type=parse_bool, metavar="BOOL", help=help_text
    )
    parser.add_argument(f"--no-{name}", dest=dest, action="store_false", help=f"same as --{name} False")


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "at least 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "at least 0")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a finite number > 0")  # nan too is refused


def non_negative_float(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < math.inf, "a finite number >= 0")


def _number(text: str, kind: type, ok: Callable[[Any], bool], wanted: str) -> Any:
    """`text` as `kind`, `ok`; else argparse reports 'argument --flag: must be <wanted>, got <text>'."""
    try:
        value = kind(text)
    except ValueError:
        wanted = f"an integer {wanted.replace('at least', 'of at least')}" if kind is int else wanted
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value
