"""Checkpoint schema of FSDP shard files (see /work/shared/FORMAT.md) and the reshard error.

The TypedDicts describe what `torch.load` returns; they are documentation for
readers and type checkers, not runtime validation (that is in `layout` and `optim`).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypedDict

from metaseq.torchzip import TensorRef

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checkpoint",
    "ConsolidatedOptimizerState",
    "FlatOptimizerState",
    "InstanceMetadata",
    "ParamMetadata",
    "ReshardError",
    "ShardMetadata",
    "clean_key",
    "is_tensor",
    "join_key",
]

WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


class ReshardError(ValueError):
    """Inputs or options that cannot be resharded; the message names the culprit and the fix."""


class ParamMetadata(TypedDict):
    names: list[str]  # relative to the instance's fsdp_path; tied params appear once
    shapes: list[torch.Size]  # full, unsharded shapes
    numels: list[int]
    padding: int  # zeros appended on this rank


class _InstanceRequired(TypedDict):
    fsdp_path: str  # "" for the root instance
    params: dict[str, ParamMetadata]  # keyed by backing name, e.g. "flat_param_0"


class InstanceMetadata(_InstanceRequired, total=False):
    no_broadcast_optim_state: bool  # absent in older files
    shared_param_info: list[tuple[str, str]]  # (src, dst), relative to fsdp_path


class ShardMetadata(TypedDict):
    param_metadata: list[InstanceMetadata]  # root first
    buffer_names: list[str]


class _OptimizerRequired(TypedDict):
    state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]


class FlatOptimizerState(_OptimizerRequired, total=False):
    """One rank's `optimizer.state_dict()`: state id k is the k-th flat parameter, 1-D padded tensors."""

    loss_scale: float


class ConsolidatedOptimizerState(_OptimizerRequired, total=False):
    """fairscale's `gather_full_optim_state_dict` layout: state per original parameter."""

    param_id_map: dict[int, int | None]  # global (original param) id -> local (flat param) id
    uncollected_local_ids: list[int]
    loss_scale: float


class Checkpoint(TypedDict, total=False):
    model: dict[str, Any]
    shard_metadata: ShardMetadata
    last_optimizer_state: FlatOptimizerState | ConsolidatedOptimizerState | None
    optimizer_history: list[dict[str, Any]]
    extra_state: dict[str, Any]
    cfg: dict[str, Any]


def clean_key(key: str) -> str:
    """Drop FSDP wrapper segments: `_fsdp_wrapped_module._fpw_module.decoder.x` -> `decoder.x`."""
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def is_tensor(value: Any) -> bool:
    """A torch tensor, or a `metaseq.torchzip.TensorRef` (inputs read without torch)."""
    if type(value) is TensorRef:
        return True
    torch = sys.modules.get("torch")  # not imported yet: nothing can be a torch tensor
    return torch is not None and torch.is_tensor(value)


def join_key(prefix: str, name: str) -> str:
    """`fsdp_path` + "." + name, without a leading dot for the root instance."""
    return f"{prefix}.{name}" if prefix else name
