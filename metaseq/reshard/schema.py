"""The FSDP shard file's schema (see docs/checkpoint_format.md) and the names inside it.

The TypedDicts describe what a checkpoint holds; they are documentation for readers
and type checkers, not runtime validation (that is in `layout` and `optim`).
"""
from __future__ import annotations

import argparse
from typing import Any, Iterator, Mapping, Sequence, TypedDict

from metaseq.torchzip import Opaque, Size, TensorRef

__all__ = ["Checkpoint", "FlatOptimizerState", "InstanceMetadata", "ParamMetadata", "ShardMetadata", "cfg_fields",
           "cfg_value", "clean_key", "is_omegaconf", "is_tensor", "join_key", "last_update", "resolve", "tensors_in"]

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


def tensors_in(obj: Any) -> Iterator[TensorRef]:
    """Every tensor of a checkpoint in its dicts, lists and tuples (what carried objects hold is not looked at)."""
    if is_tensor(obj):
        yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from tensors_in(value)


def last_update(structure: Mapping[str, Any]) -> Mapping[str, Any]:
    """The last entry of a checkpoint's `optimizer_history` (num_updates, lr scheduler state, ...); {} where none."""
    history = structure.get("optimizer_history")
    return history[-1] if isinstance(history, list) and history and isinstance(history[-1], Mapping) else {}


def resolve(obj: Any, path: Sequence[Any]) -> Any:
    """The value at `path` (keys from the checkpoint's dict down), e.g. ("model", "flat_param_0")."""
    for key in path:
        obj = obj[key]
    return obj


def cfg_value(cfg: Any, section: str, key: str) -> Any:
    """cfg[section][key] of a checkpoint's cfg: dicts, argparse.Namespaces or omegaconf containers, loaded or
    carried unread as `Opaque` (see `cfg_fields`); None where absent."""
    fields = cfg_fields((cfg_fields(cfg) or {}).get(section))
    value = fields.get(key) if fields is not None else None
    return value.state["_val"] if is_omegaconf(value) and "_val" in value.state else value  # a value node's


def cfg_fields(obj: Any) -> dict | Mapping | None:
    """The fields of a cfg or of one of its sections, as a mapping that changes them (Opaque's state): a dict, an
    argparse.Namespace, or a carried omegaconf container's content (its values in value nodes); None for others."""
    if is_omegaconf(obj):
        obj = obj.state.get("_content")
    elif isinstance(obj, Opaque):
        obj = obj.state
    obj = vars(obj) if isinstance(obj, argparse.Namespace) else obj
    return obj if isinstance(obj, Mapping) else None


def is_omegaconf(obj: Any) -> bool:
    """An omegaconf container or value node, carried unread: its `state` holds `_content` or `_val`."""
    return isinstance(obj, Opaque) and obj.module.startswith("omegaconf") and isinstance(obj.state, dict)
