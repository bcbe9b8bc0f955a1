"""Signals around a tool's work, for its `python -m` run: while it starts (imports) and once it is done.

Only the standard library's `os`, `signal` and `sys`: `metaseq.scripts` and `metaseq.cli`
install `stop_while_starting` before anything else of theirs is imported.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable  # (typing is slower to import)

__all__ = ["run_as_main", "stop_while_starting"]


def stop_while_starting() -> None:
    """Until `run_as_main` runs the tool, Ctrl-C or SIGTERM end it at once with one line (status 130 or 2), where
    an import would print its traceback (or torch's import swallow the Ctrl-C). Nothing is written yet."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_at_once)


def _stop_at_once(signum: int, frame: object) -> None:
    for other in (signal.SIGINT, signal.SIGTERM):  # one line, also for a burst
        signal.signal(other, signal.SIG_IGN)
    os.write(2, b"ERROR: interrupted\n" if signum == signal.SIGINT else b"ERROR: terminated by SIGTERM\n")
    os._exit(130 if signum == signal.SIGINT else 2)


def run_as_main(main: Callable[[], int]) -> None:
    """A tool's `if __name__ == "__main__"`: `main()` with Python's own signal handling, then exit with its status;
    a Ctrl-C or SIGTERM after it returned is ignored (it would interrupt torch's exit handlers with a traceback,
    and change the status)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        sys.exit(main())  # also --help's SystemExit
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
