"""The FSDP shard file's schema (see docs/checkpoint_format.md) and the names inside it.

The TypedDicts describe what a checkpoint holds; they are documentation for readers
and type checkers, not runtime validation (that is in `layout` and `optim`).
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence, TypedDict

from metaseq.torchzip import Opaque, Size, TensorRef

__all__ = ["Checkpoint", "FlatOptimizerState", "InstanceMetadata", "ParamMetadata", "ShardMetadata", "cfg_value",
           "clean_key", "is_tensor", "join_key", "resolve"]

WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})
OPTIM = "last_optimizer_state"


class ParamMetadata(TypedDict):
    names: list[str]  # relative to the instance's fsdp_path; tied params appear once
    shapes: list[Size]  # full, unsharded shapes
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


class FlatOptimizerState(TypedDict, total=False):
    """One rank's `optimizer.state_dict()`: state id k is the k-th flat parameter, 1-D padded tensors.

    fairscale's gathered layout (`gather_full_optim_state_dict`) has state per original
    parameter instead, plus `param_id_map` and `uncollected_local_ids`.
    """

    state: dict[int, dict[str, Any]]
    param_groups: list[dict[str, Any]]
    loss_scale: float


class Checkpoint(TypedDict, total=False):
    model: dict[str, Any]
    shard_metadata: ShardMetadata
    last_optimizer_state: FlatOptimizerState | None
    optimizer_history: list[dict[str, Any]]
    extra_state: dict[str, Any]
    cfg: dict[str, Any]


def clean_key(key: str) -> str:
    """Drop FSDP wrapper segments: `_fsdp_wrapped_module._fpw_module.decoder.x` -> `decoder.x`."""
    return ".".join(part for part in key.split(".") if part not in WRAPPER_SEGMENTS)


def join_key(prefix: str, name: str) -> str:
    """`fsdp_path` + "." + name, without a leading dot for the root instance."""
    return f"{prefix}.{name}" if prefix else name


def is_tensor(value: Any) -> bool:
    """A tensor of a checkpoint as `metaseq.torchzip` reads it."""
    return type(value) is TensorRef


def resolve(obj: Any, path: Sequence[Any]) -> Any:
    """The value at `path` (keys from the checkpoint's dict down), e.g. ("model", "flat_param_0")."""
    for key in path:
        obj = obj[key]
    return obj


def cfg_value(cfg: Any, section: str, key: str) -> Any:
    """cfg[section][key] of a checkpoint's cfg, its sections dicts or argparse.Namespaces (loaded, or carried
    unread as `Opaque`); None where absent."""
    fields = cfg.get(section) if isinstance(cfg, Mapping) else getattr(cfg, section, None)
    fields = fields.state if isinstance(fields, Opaque) else fields
    fields = vars(fields) if isinstance(fields, argparse.Namespace) else fields
    return fields.get(key) if isinstance(fields, Mapping) else None
