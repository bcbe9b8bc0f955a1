"""Checkpoint file naming and I/O shared by training, resharding and inference.

Only I/O lives here: no tensor math. Every writer goes through `atomic_torch_save`
so that a crash never leaves a partial file at a final path.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointLoadError",
    "atomic_torch_save",
    "load_checkpoint",
    "natural_sort_key",
    "shard_file_name",
]

# Types this project's checkpoints may contain besides tensors and builtins.
# torch.Size (shapes in shard_metadata) is allowed by torch already.
SAFE_GLOBALS = [argparse.Namespace]


class CheckpointLoadError(RuntimeError):
    """A checkpoint file could not be read; the message names the file and the fix."""


def shard_file_name(prefix: str, model_part: int, shard: int) -> str:
    """`checkpoint_last` -> `checkpoint_last-model_part-0-shard3.pt` (metaseq's naming)."""
    return f"{prefix}-model_part-{model_part}-shard{shard}.pt"


def natural_sort_key(path: str | os.PathLike) -> list:
    """Sort key that puts `shard10` after `shard2`."""
    parts = re.split(r"(\d+)", str(path))
    return [int(p) if p.isdigit() else p for p in parts]


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` to a temp file in the target folder, fsync, rename, fsync the folder.

    Either the final path holds the complete file or it is left untouched.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike, *, mmap: bool = False, trust: bool = False) -> dict:
    """Load one checkpoint file safely.

    By default only tensors, builtins, `torch.Size` and `argparse.Namespace` are
    unpickled (`weights_only=True`). `trust=True` allows arbitrary pickles; only for
    files from a trusted source. `mmap=True` maps tensor storages from disk instead
    of reading them, so memory is spent only on what is touched.
    """
    path = str(path)
    try:
        if trust:
            obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
        else:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except FileNotFoundError:
        raise CheckpointLoadError(f"{path}: no such file") from None
    except Exception as e:  # unsafe type, truncated, corrupt, not a torch file
        if not trust and "Unsupported global" in str(e):
            raise CheckpointLoadError(
                f"{path}: refusing to unpickle a type outside the checkpoint format "
                f"({_unsupported_global(e)}); if you trust this file, pass --trust-checkpoint"
            ) from None
        raise CheckpointLoadError(
            f"{path}: cannot read checkpoint ({type(e).__name__}: {_first_line(e)}); "
            "the file is truncated, corrupt or not a torch checkpoint"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointLoadError(f"{path}: expected a dict checkpoint, found {type(obj).__name__}")
    return obj


def _unsupported_global(e: BaseException) -> str:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return f"it contains {match.group(1)}" if match else "it needs arbitrary unpickling"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else ""
