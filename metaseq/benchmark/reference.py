"""What the reshard tool is measured against.

- `load_and_save`: `torch.load` every shard and `torch.save` it unchanged. A
  reshard cannot do less work than this, so it is the speed baseline.
- `load_everything_reshard`: the approach of earlier tools, kept only as a
  reference point for the memory plot: load ALL shards fully into RAM (no mmap),
  then concatenate the unpadded pieces into one flat checkpoint (N -> 1, with
  optimizer state). Peak memory is about twice the checkpoint size.

With `real_structured` inputs (upstream metaseq's structure, whose rank 0 pickles an upstream
class), both load as upstream's loader does: a trusting `torch.load` with the class defined,
here through `upstream_stubs.upstream_classes()`.
"""
from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from metaseq.benchmark.upstream_stubs import upstream_classes
from metaseq.file_io import atomic_torch_save, load_checkpoint

__all__ = ["consolidate_flat_shards", "load_and_save", "load_everything_reshard"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def load_and_save(paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
                  real_structured: bool = False) -> None:
    """Copy each shard through `torch.load` + `torch.save`, one file in memory at a time."""
    with _upstream(real_structured):
        for path in paths:
            ckpt = load_checkpoint(path, trust=real_structured)
            atomic_torch_save(ckpt, Path(out_dir) / Path(path).name)
            del ckpt


def load_everything_reshard(paths: Sequence[str | os.PathLike], output: str | os.PathLike, *,
                            real_structured: bool = False) -> None:
    """N flat shards -> one flat shard, holding every input in RAM at once (the old way)."""
    with _upstream(real_structured):
        shards = [load_checkpoint(p, trust=real_structured) for p in paths]
        atomic_torch_save(consolidate_flat_shards(shards), output)


def _upstream(real_structured: bool) -> contextlib.AbstractContextManager:
    return upstream_classes() if real_structured else contextlib.nullcontext()


def consolidate_flat_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank-ordered flat shards -> the single-shard checkpoint (pure: no I/O).

    Each flat parameter and its Adam moments lose the rank's own padding and are
    concatenated in rank order; the metadata then records padding 0. Everything
    else is taken from rank 0.
    """
    first = shards[0]
    out = {k: v for k, v in first.items() if k not in ("model", "shard_metadata", "last_optimizer_state")}
    metadata = copy.deepcopy(first["shard_metadata"])
    model = dict(first["model"])  # buffers stay as rank 0 has them
    optim = first.get("last_optimizer_state")
    state = {}
    per_shard = [_flat_params(s["shard_metadata"]) for s in shards]
    for k, (key, backing) in enumerate(_flat_params(metadata)):
        paddings = [flat[k][1]["padding"] for flat in per_shard]
        model[key] = _unpad_cat([s["model"][key] for s in shards], paddings)
        backing["padding"] = 0
        if optim is not None:
            moments = {m: _unpad_cat([s["last_optimizer_state"]["state"][k][m] for s in shards], paddings)
                       for m in MOMENT_KEYS}
            state[k] = {**optim["state"][k], **moments}
    out["model"], out["shard_metadata"] = model, metadata
    if optim is not None:
        out["last_optimizer_state"] = {**optim, "state": state}
    return out


def _flat_params(metadata: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(model key, its `params` entry) of every flat parameter, in optimizer-state order."""
    found = []
    for instance in metadata["param_metadata"]:
        for name, backing in instance["params"].items():
            key = f"{instance['fsdp_path']}.{name}" if instance["fsdp_path"] else name
            found.append((key, backing))
    return found


def _unpad_cat(pieces: list[torch.Tensor], paddings: list[int]) -> torch.Tensor:
    return torch.cat([p[: p.numel() - pad] for p, pad in zip(pieces, paddings)])
