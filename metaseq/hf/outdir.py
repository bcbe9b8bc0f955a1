"""Write a whole output folder atomically: build it under a hidden temp name, then rename it into place."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from metaseq.hf.errors import ConversionError

__all__ = ["atomic_directory", "check_output_directory"]


def check_output_directory(path: str | os.PathLike, *, overwrite: bool, flag: str = "--output") -> None:
    """Refuse a file, or an existing non-empty folder without `overwrite`, before anything is read or written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConversionError(f"{flag} {path} is a file; give a folder name")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ConversionError(f"{flag} {path} exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it replaces `path` (parents created).

    On any error the temp folder is removed and `path` is left as it was. An existing
    folder is replaced only with `overwrite` (or when empty).
    """
    path = Path(path)
    check_output_directory(path, overwrite=overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
        _swap_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rename(path, old / path.name)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
