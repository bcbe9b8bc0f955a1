"""Optimizer state (`last_optimizer_state`) of FSDP shards: analysis and output assembly (pure).

Two input layouts are understood:
- flat (what every rank saves): `state[k]` belongs to the k-th flat parameter; each
  1-D tensor there (Adam's moments) is padded exactly like that parameter on that rank;
- consolidated (fairscale's `gather_full_optim_state_dict`): `state[g]` per ORIGINAL
  parameter with its shape, plus `param_id_map` and `uncollected_local_ids`.
Either is written as either: flat shards for any world size, or the consolidated
layout that `FSDP.get_shard_from_optim_state_dict` loads at any world size.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from metaseq.errors import ReshardError, short_repr
from metaseq.reshard.layout import ModelLayout, check_flat_dtype, global_params
from metaseq.reshard.ranges import OutTensor, Span, Spans, plan_range
from metaseq.reshard.schema import OPTIM, clean_key, is_tensor, tensors_in
from metaseq.torchzip import DType, Size, TensorRef, pickle_bytes

__all__ = ["OptimLayout", "StateEntry", "analyze_optimizer", "assemble_consolidated_optimizer",
           "assemble_flat_optimizer", "check_per_rank_state", "differing_settings", "optimizer_settings",
           "optimizer_targets", "scalar_key"]

logger = logging.getLogger(__name__)

LAYOUT_KEYS = ("state", "param_id_map", "uncollected_local_ids")
ZERO_AT_PADDING = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")  # torch's Adam(W) and SGD: sums of
# gradients, zero where no gradient reaches (the padding); Adagrad's `sum` starts at initial_accumulator_value


def _is_scalar_tensor(value: Any) -> bool:
    return is_tensor(value) and value.dim() == 0


def _copy_scalar(value: Any) -> Any:
    return value.compact() if is_tensor(value) else copy.deepcopy(value)


def scalar_key(value: Any) -> Any:
    """`value` (a number, a one-element tensor, a list of them) comparable with == (NaN equal to NaN)."""
    if is_tensor(value):
        return (repr(value.dtype), scalar_key(value.value()) if value.numel() == 1 else tuple(value.shape))
    if isinstance(value, float) and value != value:
        return "nan"
    return tuple(map(scalar_key, value)) if isinstance(value, list) else value


@dataclass(frozen=True)
class StateEntry:
    """One named state of one flat parameter: a per-element tensor or a scalar."""

    name: str
    segments: Spans | None = None  # tensor state: unpadded elements, in order
    dtype: DType | None = None
    values: tuple[Any, ...] = ()  # scalar state: one value per input rank
    gathered: bool = False  # values came as fairscale's per-rank list of 0-dim tensors

    @functools.cached_property  # asked once per output
    def per_rank(self) -> bool:
        """Tensor values that differ between ranks (e.g. the scales of --fp16-adam-stats moments)."""
        return self.name != "step" and len({v.value() for v in self.values if is_tensor(v)}) > 1  # 0-dim tensors

    def flat_value(self, rank: int) -> Any:
        """Scalar for one rank of a flat output: rank 0's, or, per rank, that rank's (like fairscale)."""
        own = (self.gathered or self.per_rank) and rank < len(self.values)
        return _copy_scalar(self.values[rank if own else 0])

    def consolidated_value(self) -> Any:
        """Scalar as `gather_full_optim_state_dict` writes it: `step` a number, 0-dim tensors per rank."""
        first = self.values[0]
        if self.name == "step" and _is_scalar_tensor(first):
            return first.value()
        if self.gathered or _is_scalar_tensor(first):
            return [v.compact(Size(d for d in v.shape if d != 1)) for v in self.values]  # 0-dim
        return _copy_scalar(first)


def check_per_rank_state(optim: OptimLayout, model: ModelLayout, num_output_shards: int, unflatten: bool) -> None:
    """Refuse per-rank scalars (see StateEntry.per_rank) for outputs whose ranks hold other elements: only as
    many flat outputs (the same elements per rank) keep them right."""
    for k, entries in optim.entries.items():
        for e in (e for e in entries if e.per_rank and (unflatten or len(e.values) != num_output_shards)):
            moved = "--unflatten-weights" if unflatten else f"--num-output-shards={num_output_shards}"
            raise ReshardError(f"{model.labels[0]}: {OPTIM}.state[{k}]['{e.name}'] differs between the {len(e.values)} "
                               "input ranks: per-rank state (e.g. the scale of --fp16-adam-stats moments) belongs to "
                               f"the elements each rank holds, which move with {moved}; keep {len(e.values)} flat "
                               "shards or pass --skip-optimizer-state")


@dataclass(frozen=True)
class OptimLayout:
    consolidated: bool  # the input is in fairscale's consolidated layout
    entries: Mapping[int, tuple[StateEntry, ...]]  # flat param index -> its states, input order
    num_param_groups: int


def analyze_optimizer(shards: Sequence[Mapping[str, Any]], model: ModelLayout) -> OptimLayout | None:
    """Check every input's optimizer state against the flat parameters; None when there is none."""
    osds = [s.get(OPTIM) for s in shards]
    having = next((label for osd, label in zip(osds, model.labels) if osd is not None), None)
    if having is None:
        return None
    for osd, label in zip(osds, model.labels):
        if osd is None:
            raise ReshardError(f"{label}: no {OPTIM}, which {having} has; pass --skip-optimizer-state to drop it")
        if not isinstance(osd, Mapping) or not {"state", "param_groups"} <= set(osd):
            raise ReshardError(f"{label}: {OPTIM} has no 'state' and 'param_groups' (not a torch optimizer "
                               "state_dict); pass --skip-optimizer-state to drop it")
    consolidated = "param_id_map" in osds[0]
    if model.unflattened and not consolidated:
        raise ReshardError(f"{model.labels[0]}: unflattened weights beside one rank's optimizer state (no "
                           "param_id_map), as FSDP with flatten_parameters=False saves at world size 1; resharding "
                           "such optimizer state is not supported: pass --skip-optimizer-state")
    if not consolidated:
        _check_state_order(shards[0]["model"], model)
        given = sum(len(g.get("params") or ()) for g in osds[0]["param_groups"] if isinstance(g, Mapping))
        if given != len(model.flat_params):  # state id k is then not the k-th flat parameter, nor is it recorded
            raise ReshardError(f"{model.labels[0]}: {OPTIM}.param_groups hold {given} parameters but shard_metadata "
                               f"lists {len(model.flat_params)} flat parameters: the optimizer was given some of them "
                               "(frozen ones left out?), and which is not saved; pass --skip-optimizer-state")
    entries = _consolidated_entries(osds, model) if consolidated else _flat_entries(osds, model)
    for label, (name, value, first) in ((label, d) for osd, label in zip(osds[1:], model.labels[1:])
                                        for d in differing_settings(osds[0], osd)[:1]):
        logger.warning("%s: %s.%s differs from %s's (%s vs %s): the files are not of one save, or were edited; "
                       "resharded, every output gets %s's", label, OPTIM, name, model.labels[0],
                       short_repr(value, 40), short_repr(first, 40), model.labels[0])
    return OptimLayout(consolidated, entries, len(osds[0]["param_groups"]))


def optimizer_settings(osd: Mapping[str, Any]) -> dict[str, Any]:
    """What an optimizer state holds besides the per-parameter state (one value for every rank): each param group
    without its parameter ids, loss_scale, ..."""
    settings = {key: value for key, value in osd.items() if key not in (*LAYOUT_KEYS, "param_groups")}
    settings["param_groups"] = [{k: v for k, v in group.items() if k != "params"} if isinstance(group, Mapping)
                                else group for group in osd["param_groups"]]
    return settings


def differing_settings(first: Mapping[str, Any], other: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(name, other's value, first's) of each optimizer setting that differs between two ranks' states: in what they
    pickle to, or in the bytes of a tensor they hold."""
    ours, theirs = optimizer_settings(first), optimizer_settings(other)
    pairs = [(f"param_groups[{i}]['{k}']", g.get(k), h.get(k)) for i, (g, h) in enumerate(zip(
        ours.pop("param_groups"), theirs.pop("param_groups"))) if isinstance(g, Mapping) and isinstance(h, Mapping)
        for k in {**g, **h}]
    pairs += [(key, ours.get(key), theirs.get(key)) for key in {**ours, **theirs}]
    return [(name, b, a) for name, a, b in pairs if pickle_bytes(a) != pickle_bytes(b) or not all(
        x.storage.same_bytes(y.storage) for x, y in zip(tensors_in(a), tensors_in(b)))]


def _check_state_order(model_dict: Mapping[str, Any], model: ModelLayout) -> None:
    """Flat state id k is the k-th parameter the optimizer was given: of `model.parameters()`, whose order the model
    dict keeps. shard_metadata lists the flat parameters instance by instance; the two orders differ where an
    instance with flatten_parameters=False holds parameters around nested instances."""
    listed = [fp.key for fp in model.flat_params]
    names = set(listed)
    found = [key for key in (clean_key(str(k)) for k in model_dict) if key in names]
    if found != listed:
        k = next(k for k, (a, b) in enumerate(zip(found, listed)) if a != b)
        raise ReshardError(f"{model.labels[0]}: model holds '{found[k]}' where shard_metadata lists '{listed[k]}' "
                           "(FSDP with flatten_parameters=False around nested instances?), so the optimizer state's "
                           "ids cannot be matched to parameters; pass --skip-optimizer-state")


def _flat_entries(osds: Sequence[Mapping[str, Any]], model: ModelLayout) -> dict[int, tuple[StateEntry, ...]]:
    labels, num_flat = model.labels, len(model.flat_params)
    ids = list(osds[0]["state"])
    for osd, label in zip(osds[1:], labels[1:]):
        if set(osd["state"]) != set(ids):
            raise ReshardError(f"{label}: {OPTIM} covers flat parameters {sorted(osd['state'])} but {labels[0]} "
                               f"covers {sorted(ids)}")
    for k in ids:
        if not isinstance(k, int) or not 0 <= k < num_flat:
            raise ReshardError(f"{labels[0]}: {OPTIM}.state has id {k!r} but shard_metadata lists {num_flat} flat "
                               f"parameters (ids 0..{num_flat - 1}); the optimizer state does not match the flat "
                               "parameters")
    return {k: tuple(_flat_entry(osds, model, k, name) for name in osds[0]["state"][k]) for k in sorted(ids)}


def _flat_entry(osds: Sequence[Mapping[str, Any]], model: ModelLayout, k: int, name: str) -> StateEntry:
    labels, fp = model.labels, model.flat_params[k]
    for osd, label in zip(osds, labels):
        if name not in osd["state"][k]:
            raise ReshardError(f"{label}: {OPTIM}.state[{k}] lacks '{name}', which {labels[0]} has")
    values = [osd["state"][k][name] for osd in osds]
    if not any(is_tensor(v) and v.dim() > 0 for v in values):
        odd = next((r for r, v in enumerate(values) if scalar_key(v) != scalar_key(values[0])), 0) * (name == "step")
        if odd:  # one rank's would be written for all
            shown = [v.value() if is_tensor(v) and v.numel() == 1 else v for v in (values[odd], values[0])]
            raise ReshardError(f"{labels[odd]}: {OPTIM}.state[{k}]['step'] is {shown[0]!r} but {labels[0]}'s is "
                               f"{shown[1]!r}; FSDP ranks step together, so the shards come from different saves")
        return StateEntry(name, values=tuple(values))
    for value, label, expected in zip(values, labels, model.padded_lengths[k]):
        if not is_tensor(value) or value.dim() != 1 or value.numel() != expected:
            found = list(value.shape) if is_tensor(value) else type(value).__name__
            groups = len(osds[0]["param_groups"])
            order = (f" (state id k is the k-th parameter the optimizer was given: do its {groups} param groups list "
                     "them in another order than the model's?)") if groups > 1 else ""
            raise ReshardError(f"{label}: {OPTIM}.state[{k}]['{name}'] has shape {found} but flat parameter "
                               f"'{fp.key}' has {expected} elements there; the optimizer state does not match the "
                               f"flat parameters{order}; pass --skip-optimizer-state to drop it")
    for value, label in zip(values[1:], labels[1:]):
        check_flat_dtype(value.dtype, values[0].dtype, f"{label}: {OPTIM}.state[{k}]['{name}']", f"{labels[0]}'s",
                         fp.key)
    if name in ZERO_AT_PADDING:
        _check_zero_padding(values, model, k, name)
    segments = [Span(model.first + r, (OPTIM, "state", k, name), 0, n) for r, n in enumerate(model.kept_lengths[k])]
    return StateEntry(name, segments=Spans(segments), dtype=values[0].dtype)


def _check_zero_padding(values: Sequence[TensorRef], model: ModelLayout, k: int, name: str) -> None:
    """Refuse a state of flat parameter k whose padding holds a nonzero number (NaN aside): no gradient reaches the
    padding, so the state there is zero, unless it is another flat parameter's state, as where the optimizer's
    state ids do not follow shard_metadata's order (of equal lengths per rank, nothing else tells)."""
    for value, label, kept, padded in zip(values, model.labels, model.kept_lengths[k], model.padded_lengths[k]):
        size = value.dtype.itemsize
        if kept == padded or not value.dtype.is_floating_point or value.stride != (1,):
            continue
        data = value.storage.read((value.storage_offset + kept) * size, (padded - kept) * size)
        if any(v != 0 and v == v for v in value.dtype.unpack(data)):  # a NaN: the padding's own (Adam with eps=0)
            raise ReshardError(f"{label}: {OPTIM}.state[{k}]['{name}'] is nonzero in the padding of "
                               f"flat parameter '{model.flat_params[k].key}', where no gradient reaches: it is another "
                               "parameter's state, as where the optimizer was given the parameters in another order "
                               "than the model's (param groups?); build it from model.parameters() in order, or pass "
                               "--skip-optimizer-state")


def _consolidated_entries(osds: Sequence[Mapping[str, Any]], model: ModelLayout) -> dict[int, tuple[StateEntry, ...]]:
    label, osd = model.labels[0], osds[0]
    if len(osds) > 1:
        raise ReshardError(f"{label}: holds consolidated optimizer state (param_id_map) but is one of several shards")
    if osd.get("uncollected_local_ids"):
        raise ReshardError(f"{label}: {OPTIM} has uncollected_local_ids (no_broadcast_optim_state); not supported")
    state, id_map = osd["state"], osd.get("param_id_map") or {}
    by_flat: dict[int, list[int]] = {}
    for g, k, _ in global_params(model):
        by_flat.setdefault(k, []).append(g)
        if g in state and id_map.get(g, k) not in (k, None):
            raise ReshardError(f"{label}: {OPTIM}.param_id_map maps parameter {g} to flat parameter {id_map[g]}, "
                               f"expected {k}; the optimizer state comes from a different FSDP wrapping")
    total = sum(len(ids) for ids in by_flat.values())
    unknown = [g for g in state if not isinstance(g, int) or not 0 <= g < total]
    if unknown:
        raise ReshardError(f"{label}: {OPTIM}.state has id {unknown[0]!r} but shard_metadata lists {total} parameters")
    entries = {}
    per_element = _per_element_names(state, model)
    for k, ids in by_flat.items():
        fp, missing = model.flat_params[k], [g for g in ids if g not in state]
        if missing and len(missing) < len(ids):
            raise ReshardError(f"{label}: {OPTIM}.state lacks parameters {missing} of flat parameter '{fp.key}'")
        if not missing:
            entries[k] = tuple(_consolidated_entry(state, model, k, ids, name, name in per_element)
                               for name in state[ids[0]])
    return entries


def _per_element_names(state: Mapping[int, Mapping[str, Any]], model: ModelLayout) -> frozenset[str]:
    """State names with one value per parameter element (Adam's moments), not a scalar (step). For a 0-dim
    parameter both are 0-dim tensors: such a name is per-element when it has dims for some other parameter,
    or is not "step" and has the parameter's shape everywhere."""
    shapes = {g: model.flat_params[k].shapes[j] for g, k, j in global_params(model)}
    names = {name for entry in state.values() for name in entry}
    found = {name: [(g, entry[name]) for g, entry in state.items() if name in entry] for name in names}
    return frozenset(name for name, values in found.items()
                     if any(is_tensor(v) and v.dim() > 0 for _, v in values)
                     or name != "step" and all(is_tensor(v) and v.shape == shapes.get(g) for g, v in values))


def _consolidated_entry(state: Mapping[int, Mapping[str, Any]], model: ModelLayout, k: int, ids: Sequence[int],
                        name: str, per_element: bool) -> StateEntry:
    first, fp = state[ids[0]][name], model.flat_params[k]
    if not per_element:
        odd = next((g for g in ids[1:] if scalar_key(state[g].get(name)) != scalar_key(first)), None)
        if odd is not None:  # one value per flat parameter is kept: the others' would be lost
            raise ReshardError(f"{model.labels[0]}: {OPTIM}.state[{odd}]['{name}'] is {state[odd].get(name)!r} but "
                               f"state[{ids[0]}]['{name}'] is {first!r}; both are of flat parameter '{fp.key}', which "
                               "FSDP steps as one: give them one value, or pass --skip-optimizer-state")
        gathered = isinstance(first, list) and bool(first) and all(_is_scalar_tensor(v) for v in first)
        return StateEntry(name, values=tuple(first) if gathered else (first,), gathered=gathered)
    for g, param_name, shape in zip(ids, fp.names, fp.shapes):
        value = state[g].get(name)
        if not is_tensor(value) or value.numel() != shape.numel():
            found = list(value.shape) if is_tensor(value) else type(value).__name__
            raise ReshardError(f"{model.labels[0]}: {OPTIM}.state[{g}]['{name}'] has shape {found} but parameter "
                               f"'{param_name}' has shape {list(shape)}")
        check_flat_dtype(value.dtype, first.dtype, f"{model.labels[0]}: {OPTIM}.state[{g}]['{name}']",
                         f"state[{ids[0]}]'s", fp.key)
    segments = [Span(model.first, (OPTIM, "state", g, name), 0, shape.numel()) for g, shape in zip(ids, fp.shapes)]
    return StateEntry(name, segments=Spans(segments), dtype=first.dtype)


def optimizer_targets(optim: OptimLayout, cuts: Sequence[tuple[int, int, str, int, int, Size]]) -> list[OutTensor]:
    """Per output tensor of `layout.output_cuts` (state id i, flat parameter k, key, start, end, shape): state i's
    per-element states, elements [start, end) of k's."""
    return [OutTensor((OPTIM, "state", i, e.name), shape, e.dtype, plan_range(e.segments, start, end))
            for i, k, _, start, end, shape in cuts for e in optim.entries.get(k, ()) if e.segments is not None]


def assemble_flat_optimizer(osd0: Mapping[str, Any], optim: OptimLayout, model: ModelLayout,
                            tensors: Mapping[tuple, TensorRef], rank: int) -> dict[str, Any]:
    """One rank's flat optimizer state_dict; other keys (param_groups, loss_scale) from rank 0."""
    ids = len(model.flat_params) if optim.consolidated else None  # one per flat parameter, as flatten_optim_state_dict
    return _assembled(osd0, optim.entries, tensors, lambda e: e.flat_value(rank), ids)


def assemble_consolidated_optimizer(osd0: Mapping[str, Any], optim: OptimLayout, model: ModelLayout,
                                    tensors: Mapping[tuple, TensorRef]) -> dict[str, Any]:
    """fairscale's consolidated layout, exactly as `gather_full_optim_state_dict` returns it."""
    id_map = {g: k if k in optim.entries else None for g, k, _ in global_params(model)}
    entries = {g: optim.entries[k] for g, k in id_map.items() if k is not None}
    out = _assembled(osd0, entries, tensors, StateEntry.consolidated_value, len(id_map))
    return {**out, "param_id_map": id_map, "uncollected_local_ids": []}


def _assembled(osd0: Mapping[str, Any], entries: Mapping[int, Sequence[StateEntry]], tensors: Mapping[tuple, TensorRef],
               scalar: Callable[[StateEntry], Any], ids: int | None) -> dict[str, Any]:
    """State id i holding the states `entries[i]` (tensors as planned, scalars by `scalar`), then the keys of `osd0`
    other than LAYOUT_KEYS (param_groups copied; with `ids`, the first group's params 0..ids-1)."""
    state = {i: {e.name: tensors[(OPTIM, "state", i, e.name)] if e.segments is not None else scalar(e) for e in states}
             for i, states in entries.items()}
    carried = {key: copy.deepcopy(value) if key == "param_groups" else value
               for key, value in osd0.items() if key not in LAYOUT_KEYS}
    if ids is not None:
        carried["param_groups"][0]["params"] = list(range(ids))
    return {"state": state, **carried}
