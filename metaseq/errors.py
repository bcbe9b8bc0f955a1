"""The errors a user can act on: their message names the culprit and the fix.

Command lines print such an error as its message alone (`metaseq.cli_logging`);
any other exception is a bug and keeps its type name in the report.
"""
from __future__ import annotations

import dataclasses

__all__ = ["CheckpointLoadError", "ReshardError", "UserError", "check_field_types", "one_line_error", "short_repr"]

_KINDS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "None": (type(None),)}
_WHAT = {"str": "a string", "int": "an integer", "float": "a number", "bool": "True or False", "None": "None"}


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


def check_field_types(options: object, error: type[Exception]) -> None:
    """Raise `error` naming the flag (`--field-name`) of the first field of the dataclass `options` whose value is
    not of its annotated type (`int`, `str | None`, ...: an int is a float too, a bool only a bool), as library
    callers may pass anything."""
    for f in dataclasses.fields(options):
        names, value = f.type.split(" | "), getattr(options, f.name)
        if not isinstance(value, tuple(k for n in names for k in _KINDS[n])) or type(value) is bool and (
                "bool" not in names):
            raise error(f"--{f.name.replace('_', '-')}={value!r}: must be {' or '.join(_WHAT[n] for n in names)}")


def short_repr(value: object, limit: int) -> str:
    """`repr(value)`, cut to `limit` characters (ending in "...") for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
