"""The errors a user can act on: their message names the culprit and the fix.

Command lines print such an error as its message alone (`metaseq.cli_logging`);
any other exception is a bug and keeps its type name in the report.
"""
from __future__ import annotations

__all__ = ["CheckpointLoadError", "ReshardError", "UserError", "one_line_error", "short_repr"]


class UserError(Exception):
    """Bad input or options; `str(error)` is the whole one-line report."""


class CheckpointLoadError(UserError, RuntimeError):
    """A checkpoint file could not be read; the message names the file and the fix."""


class ReshardError(UserError, ValueError):
    """Inputs or options that cannot be resharded; the message names the culprit and the fix."""


def one_line_error(err: BaseException) -> str:
    """The error as one line; other error types than ours (and OSError) keep their type name for the bug report."""
    text = " ".join(str(err).split())
    return text if isinstance(err, (UserError, OSError)) else f"{type(err).__name__}: {text}"


def short_repr(value: object, limit: int) -> str:
    """`repr(value)`, cut to `limit` characters (ending in "...") for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
