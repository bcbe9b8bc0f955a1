"""Logging and error reporting shared by the command-line tools.

Library code only logs; a CLI's `main()` wraps its run in `cli_logging()` so that
messages go to stderr as `LEVEL: message` for that call alone, and reports any
error with `one_line_error()`: one line, no traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Iterator

from metaseq.errors import UserError, one_line_error

__all__ = ["OneLineErrorParser", "cli_logging", "one_line_error"]


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
