"""Build, write and find raw FSDP training checkpoints (one file per rank).

The layout is the one in docs/checkpoint_format.md: `model` is fairscale's
`local_state_dict()`, `shard_metadata` its `local_metadata_dict()`, and
`last_optimizer_state` this rank's (sharded, flat) `optimizer.state_dict()`.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from metaseq.file_io import atomic_torch_save, natural_sort_key, shard_file_name

__all__ = [
    "RestoreError",
    "build_training_checkpoint",
    "find_restore_files",
    "is_consolidated_file",
    "restore_prefix",
    "save_training_checkpoint",
]


class RestoreError(ValueError):
    """--restore-file cannot be used as given; the message says why and what to do."""


def build_training_checkpoint(
    model: Any,
    optimizer: torch.optim.Optimizer,
    *,
    num_updates: int,
    train_iterator: dict[str, int],
    cfg: dict[str, Any],
    metrics: dict[str, float],
    training_time: float,
) -> dict[str, Any]:
    """This rank's checkpoint dict; `model` is the root FSDP instance."""
    return {
        "model": model.local_state_dict(),
        "shard_metadata": model.local_metadata_dict(),
        "last_optimizer_state": optimizer.state_dict(),
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": type(optimizer).__name__,
                "lr_scheduler_state": {"lr": optimizer.param_groups[0]["lr"]},
                "num_updates": num_updates,
            }
        ],
        "extra_state": {
            "metrics": metrics,
            "previous_training_time": training_time,
            "train_iterator": train_iterator,
        },
        "cfg": cfg,
    }


def save_training_checkpoint(state: dict[str, Any], save_dir: str, *, rank: int, num_updates: int) -> list[str]:
    """Write `checkpoint_{n}-...` and `checkpoint_last-...` for this rank, atomically."""
    paths = []
    for prefix in (f"checkpoint_{num_updates}", "checkpoint_last"):
        path = os.path.join(save_dir, shard_file_name(prefix, 0, rank))
        atomic_torch_save(state, path)
        paths.append(path)
    return paths


def restore_prefix(restore_file: str) -> str:
    """`DIR/checkpoint_last.pt` -> `DIR/checkpoint_last` (also accepts a shard file's name)."""
    prefix = re.sub(r"\.pt$", "", restore_file)
    return re.sub(r"-model_part-\d+-shard\d+$", "", prefix)


def is_consolidated_file(restore_file: str) -> bool:
    """A single consolidated file (e.g. `reshard-model_part-0.pt`) rather than a shard stem."""
    return os.path.isfile(restore_file) and not re.search(r"-shard\d+\.pt$", restore_file)


def find_restore_files(restore_file: str, world_size: int) -> list[str]:
    """The file each rank loads for `--restore-file`, checked against the world size.

    A consolidated file is loaded by every rank; a stem (`DIR/checkpoint_last.pt`)
    names one shard file per rank, and their number must equal the world size.
    """
    if is_consolidated_file(restore_file):
        return [restore_file] * world_size
    prefix = restore_prefix(restore_file)
    pattern = f"{glob.escape(prefix)}-model_part-0-shard*.pt"
    files = sorted(glob.glob(pattern), key=natural_sort_key)
    if not files:
        raise RestoreError(f"--restore-file {restore_file}: no shard files match {pattern}")
    if len(files) != world_size:
        raise RestoreError(
            f"--restore-file {restore_file}: found {len(files)} shard files but --world-size={world_size}; "
            f"reshard first: python -m metaseq.scripts.reshard_fsdp --input-glob-pattern '{pattern}' "
            f"--output-shard-name 'NEW_DIR/checkpoint_last-model_part-0-shard{{i}}.pt' "
            f"--num-output-shards {world_size}"
        )
    expected = [shard_file_name(prefix, 0, r) for r in range(world_size)]
    if files != expected:
        raise RestoreError(f"--restore-file {restore_file}: expected shard files {expected}, found {files}")
    return files
