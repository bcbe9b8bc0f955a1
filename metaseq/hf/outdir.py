"""Write a whole output folder atomically: build it under a hidden temp name, then rename it into place."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from metaseq.file_io import file_in_the_way
from metaseq.hf.errors import ConversionError
from metaseq.torchzip import signals_held

__all__ = ["MODEL_FOLDER_FILE", "TOKENIZER_FILE", "atomic_directory", "check_output_directory"]

# The files of a Hugging Face model folder (weights, configs, tokenizer): what --overwrite may replace.
TOKENIZER_FILE = re.compile(r"(tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab)\.json|merges\.txt"
                            r"|.*\.model")
MODEL_FOLDER_FILE = re.compile(rf"{TOKENIZER_FILE.pattern}|(generation_)?config\.json|.*\.safetensors(\.index\.json)?"
                               r"|pytorch_model.*\.bin(\.index\.json)?|README\.md|\.gitattributes")


def check_output_directory(path: str | os.PathLike, *, overwrite: bool, inputs: Sequence[str] = (),
                           flag: str = "--output") -> None:
    """Refuse, before anything is read or written: a file; an existing non-empty folder without `overwrite`, or with
    it one holding anything but a model folder's files (MODEL_FOLDER_FILE); a folder that holds one of the `inputs`
    (replacing it would delete them) or the current folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConversionError(f"{flag} {path} is a file; give a folder name")
    if blocker := file_in_the_way(path):
        raise ConversionError(f"{flag} {path} would be in {blocker}, which is a file, not a folder; give a path in a "
                              "folder")
    if not path.is_dir():
        return
    real = path.resolve()
    for name in inputs:
        if real in Path(name).resolve().parents:
            raise ConversionError(f"{flag} {path} holds the input {name}, which replacing the folder would delete; "
                                  f"give {flag} a folder without inputs, e.g. {flag} {os.path.join(path, 'hf_model')}")
    if real == Path.cwd().resolve() or real in Path.cwd().resolve().parents:
        raise ConversionError(f"{flag} {path} is (or holds) the current folder, which cannot be replaced; "
                              f"give {flag} a new folder, e.g. {flag} hf_model")
    entries = sorted(path.iterdir())
    if entries and not overwrite:
        raise ConversionError(f"{flag} {path} exists and is not empty; pass --overwrite to replace it")
    others = [e for e in entries if e.is_dir() or not MODEL_FOLDER_FILE.fullmatch(e.name)]
    if others:  # the user's own files: replacing the folder would delete them
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise ConversionError(f"{flag} {path} holds {others[0].name}{more}, which is not part of a Hugging Face model "
                              "folder; --overwrite replaces the whole folder, so move them or give another folder")


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool, flag: str = "--output") -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success it replaces `path` (parents created).

    On any error the temp folder is removed and `path` is left as it was. An existing
    folder is replaced only with `overwrite` (or when empty). A folder that cannot be
    created or written is reported as a ConversionError naming `flag`.
    """
    path = Path(os.path.abspath(path))  # `.name` of "." or "dir/.." is not the folder's name
    if path.is_symlink() and path.is_dir():  # a link to a folder: that folder is the one to replace
        path = path.resolve()
    check_output_directory(path, overwrite=overwrite, flag=flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        raise ConversionError(f"{flag} {path}: cannot create it ({e.strerror}); choose a folder you can write to"
                              ) from None
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
        _swap_into_place(tmp, path)
    except BaseException as e:
        with signals_held():  # a second Ctrl-C would leave it half removed
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ConversionError(f"{flag} {path}: cannot write it ({e.strerror or e}); nothing was written; "
                                  "check the free space and permissions there") from None
        raise


def _swap_into_place(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    try:
        os.rename(path, old / path.name)
    except BaseException:
        old.rmdir()
        raise
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old / path.name, path)  # put the old folder back
        old.rmdir()
        raise
    with signals_held():  # (a big file takes a while to unlink)
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
