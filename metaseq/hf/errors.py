"""The one error type of the Hugging Face bridge."""
from __future__ import annotations

from metaseq.errors import UserError

__all__ = ["ConversionError"]


class ConversionError(UserError, ValueError):
    """A model or folder that cannot be converted as given; the message is one line naming
    the culprit (file, field or flag) and what to do. Command lines exit 2 on it."""
