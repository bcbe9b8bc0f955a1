"""Read and cross-check the model side of a set of FSDP shards (pure: no I/O).

`analyze_model` turns the inputs' `shard_metadata` and `model` dicts into a
`ModelLayout`: every flat parameter with its original names/shapes and the
`Span`s that hold its unpadded elements. Inputs are either N flat shards
(`flat_param_*` keys, one per FSDP instance) or ONE unflattened file (original
parameter names plus `shard_metadata`, as `--unflatten-weights` writes). Tensors are
`metaseq.torchzip.TensorRef`s: only shapes and dtypes are read here.
"""
from __future__ import annotations

import copy
import functools
import itertools
import re
from dataclasses import dataclass, fields, replace
from typing import Any, Iterator, Mapping, Sequence

from metaseq.errors import ReshardError, short_repr
from metaseq.reshard.ranges import Span, Spans, shard_range
from metaseq.reshard.schema import ShardMetadata, cfg_value, clean_key, is_tensor, join_key
from metaseq.torchzip import DType, Size

__all__ = ["MIRRORS", "Extra", "FlatParam", "ModelLayout", "ParamDict", "all_ties", "analyze_model",
           "check_flat_dtype", "global_params", "missing_shards_hint", "output_cuts", "output_metadata"]

# extra_state dicts that hold state per flat parameter, laid out like `model` on every rank
# (upstream metaseq's --store-ema): resharded with the model, not carried from rank 0.
MIRRORS = ("ema", "ema_fp32_params")
_COMPLETE = "are the shards complete and from one checkpoint?"
_BAD_MODEL = ("{label}: {where}['{key}'] has shape {found} but shard_metadata says {shape}; its weights and "
              "shard_metadata are not of one model (edited?)")
_BAD_MIRROR = ("{label}: {where}['{key}'] is {found}, not {shape} like model's; {where} must hold the flat parameters "
               "exactly as model does to be resharded")


@dataclass(frozen=True)
class FlatParam:
    """One FSDP flat parameter; names are full (fsdp_path-prefixed), tied params once."""

    key: str  # clean model key, e.g. "decoder.layers.0.flat_param_0"
    instance: int  # index into param_metadata
    backing_name: str  # key of its entry in that instance's "params"
    names: tuple[str, ...]
    shapes: tuple[Size, ...]

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    @property
    def flattened(self) -> bool:
        """False for a parameter FSDP keeps as it is (flatten_parameters=False): it backs itself, not flat_param_N."""
        return re.fullmatch(r"flat_param_\d+", self.backing_name) is not None

    @functools.cached_property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of each original parameter inside the unpadded flat parameter."""
        return tuple(itertools.pairwise(itertools.accumulate((s.numel() for s in self.shapes), initial=0)))


@dataclass(frozen=True)
class Extra:
    """A model entry that is not a flat parameter (a buffer), copied from rank 0."""

    key: str  # clean key
    actual_key: str  # key in rank 0's model dict
    shape: Size | None  # None: not a tensor, carried as it is
    dtype: DType | None


@dataclass(frozen=True)
class ParamDict:
    """A dict that holds the flat parameters: `model`, or a copy laid out like it (EMA, in extra_state)."""

    root: tuple[str, ...]  # where it lies: ("model",), ("extra_state", "ema")
    sources: tuple[Spans, ...]  # [k]: flat parameter k's unpadded elements, in order
    dtypes: tuple[DType, ...]  # [k]
    extras: tuple[Extra, ...]  # its other entries (buffers), from input 0
    aliases: tuple[tuple[str, str], ...] = ()  # (src, dst): entries that are a parameter's tensor (see `_aliases`)


@dataclass(frozen=True)
class ModelLayout:
    labels: tuple[str, ...]  # one per input, for messages
    unflattened: bool
    flat_params: tuple[FlatParam, ...]
    padded_lengths: tuple[tuple[int, ...], ...]  # [k][r]: flat tensor length on input r
    kept_lengths: tuple[tuple[int, ...], ...]  # [k][r]: the same without padding
    ties: tuple[tuple[str, str], ...]  # (src, dst) full names, as shard_metadata records them (see `all_ties`)
    metadata: ShardMetadata  # rank 0's, template for the outputs
    first: int = 0  # the index of input 0 among the plan's inputs (model parts: the part's first)
    dicts: tuple[ParamDict, ...] = ()  # the model's first, then the MIRRORS input 0 has


def all_ties(layout: ModelLayout) -> tuple[tuple[str, str], ...]:
    """Every tie of the model: shard_metadata's, and the parameters its dict holds under a second name."""
    return layout.ties + (layout.dicts[0].aliases if layout.dicts else ())


def global_params(layout: ModelLayout) -> Iterator[tuple[int, int, int]]:
    """(global id, flat param index k, index j in its names): fairscale's unflattened ids."""
    pairs = ((k, j) for k, fp in enumerate(layout.flat_params) for j in range(len(fp.names)))
    return ((g, k, j) for g, (k, j) in enumerate(pairs))


def output_cuts(layout: ModelLayout, unflatten: bool, world_size: int,
                rank: int) -> list[tuple[int, int, str, int, int, Size]]:
    """The output tensors an output rank makes of the flat parameters, as (state id, flat parameter k, model key,
    start, end, shape): elements [start, end) of k. Unflattened, one per original parameter, with its name and shape
    (state id: its global id); else rank `rank`'s FSDP shard of each k, padded (state id: k)."""
    fps = layout.flat_params
    if unflatten:
        return [(g, k, fps[k].names[j], *fps[k].ranges[j], fps[k].shapes[j]) for g, k, j in global_params(layout)]
    ranges = [shard_range(fp.numel, world_size, rank) for fp in fps]
    return [(k, k, fp.key, start, end, Size([padded])) for k, (fp, (start, end, padded)) in enumerate(zip(fps, ranges))]


def analyze_model(shards: Sequence[Mapping[str, Any]], labels: Sequence[str], first: int = 0) -> ModelLayout:
    """Validate the inputs against each other and locate every flat parameter's elements; `first`: see
    ModelLayout."""
    metas = [_shard_metadata(s, label) for s, label in zip(shards, labels)]
    flat_params = _parse_flat_params(metas[0], labels[0])
    for meta, label in zip(metas[1:], labels[1:]):
        _check_same_params(flat_params, _parse_flat_params(meta, label), labels[0], label)
    ties = _parse_ties(metas[0], flat_params, labels[0])
    models = [s["model"] for s in shards]
    key_maps = [_key_map(model, label, "model") for model, label in zip(models, labels)]
    forms = [_is_unflattened(km, model, flat_params, label) for km, model, label in zip(key_maps, models, labels)]
    if any(forms) and len(shards) > 1:
        raise ReshardError(f"{labels[forms.index(True)]}: looks unflattened (model keys are original parameter names) "
                           f"but was given with {len(shards) - 1} other input(s); pass a consolidated file alone")
    whole = tuple((fp.numel,) for fp in flat_params)  # unflattened: one input, no padding
    try:
        padded, kept = (whole, whole) if forms[0] else _flat_lengths(models, metas, key_maps, flat_params, labels)
    except ReshardError as e:
        hint = missing_shards_hint(shards)  # instead of the question, where the files say
        raise ReshardError(str(e).removesuffix(f"; {_COMPLETE}") + hint if hint else str(e)) from None
    layout = ModelLayout(tuple(labels), forms[0], flat_params, padded, kept, ties, metas[0], first)
    dicts = [_param_dict(layout, models, key_maps, ("model",))]
    for name in MIRRORS:  # checked on every input to hold the flat parameters as `model` does
        mirrors = [s["extra_state"].get(name) if isinstance(s.get("extra_state"), Mapping) else None for s in shards]
        where, other = f"extra_state['{name}']", next((r for r, m in enumerate(mirrors) if isinstance(m, Mapping)), 0)
        if other:  # input 0's is not a mirror, another's is
            kind = "tensor" if is_tensor(mirrors[0]) else type(mirrors[0]).__name__
            raise ReshardError(f"{labels[0]}: {where} is a {kind}, unlike {labels[other]}'s dict laid out like model; "
                               "the shards come from different runs")
        if isinstance(mirrors[0], Mapping):  # else (on every input) not a mirror: carried like other extra_state
            maps = [_key_map(entries, label, where) for entries, label in zip(mirrors, labels)]
            dicts.append(_param_dict(layout, mirrors, maps, ("extra_state", name)))
            own = {dst for _, dst in dicts[-1].aliases}
            for src, dst in (t for t in dicts[0].aliases if t[1] not in own and t[1] in maps[0]):
                raise ReshardError(f"{labels[0]}: {where}['{dst}'] is a tensor of its own, but model holds it as "
                                   f"'{src}' (tied in an instance with flatten_parameters=False); {where} must hold "
                                   "it as model does, one tensor under both names, to be resharded")
    return replace(layout, dicts=tuple(dicts))


def output_metadata(layout: ModelLayout, paddings: Sequence[int]) -> ShardMetadata:
    """Rank 0's shard_metadata with each flat parameter's padding (and, if they changed, shapes) replaced."""
    meta = copy.deepcopy(layout.metadata)
    for fp, pad in zip(layout.flat_params, paddings, strict=True):
        entry = meta["param_metadata"][fp.instance]["params"][fp.backing_name]
        entry["padding"] = pad
        if tuple(Size(s) for s in entry["shapes"]) != fp.shapes:  # another model-parallel cut: same types
            entry["shapes"] = [type(old)(new) for old, new in zip(entry["shapes"], fp.shapes)]
            entry["numels"] = [shape.numel() for shape in fp.shapes]
    return meta


def _shard_metadata(shard: Mapping[str, Any], label: str) -> ShardMetadata:
    if not isinstance(shard, Mapping) or not isinstance(shard.get("model"), Mapping):
        raise ReshardError(f"{label}: no 'model' dict; this is not a metaseq checkpoint")
    meta = shard.get("shard_metadata")
    if meta is None:
        hint = ("it has flat_param_* keys but was saved without FSDP's local_metadata_dict()"
                if any("flat_param_" in str(k) for k in shard["model"]) else
                "its model keys are plain parameter names, so it looks consolidated already or not saved by FSDP")
        raise ReshardError(f"{label}: no 'shard_metadata'; {hint}; only FSDP shards can be resharded")
    if not isinstance(meta, Mapping) or not isinstance(meta.get("param_metadata"), list):
        raise ReshardError(f"{label}: shard_metadata has no 'param_metadata' list; the file is not an FSDP shard")
    return meta


def _parse_flat_params(meta: ShardMetadata, label: str) -> tuple[FlatParam, ...]:
    flat_params = []
    try:
        for idx, inst in enumerate(meta["param_metadata"]):
            path = clean_key(inst.get("fsdp_path", ""))
            if inst.get("no_broadcast_optim_state", False):
                raise ReshardError(f"{label}: FSDP instance '{path or '<root>'}' has no_broadcast_optim_state=True "
                                   "(e.g. MoE experts, different on every rank); resharding it is not supported")
            for backing, pm in inst["params"].items():
                flat_params.append(_parse_param(idx, path, backing, pm, label))
    except (KeyError, TypeError, AttributeError) as e:
        raise ReshardError(f"{label}: malformed shard_metadata ({type(e).__name__}: {e})") from None
    return tuple(flat_params)


def _parse_param(idx: int, path: str, backing: str, pm: Mapping[str, Any], label: str) -> FlatParam:
    names = tuple(join_key(path, clean_key(n)) for n in pm["names"])
    fp = FlatParam(join_key(path, clean_key(backing)), idx, backing, names, tuple(Size(s) for s in pm["shapes"]))
    numels = [int(n) for n in pm["numels"]]  # checked, not kept: the shapes say them
    if not len(fp.names) == len(fp.shapes) == len(numels):
        raise ReshardError(f"{label}: shard_metadata of '{fp.key}' has {len(fp.names)} names, {len(fp.shapes)} "
                           f"shapes, {len(numels)} numels")
    for name, shape, n in zip(fp.names, fp.shapes, numels):
        if shape.numel() != n:
            raise ReshardError(f"{label}: shard_metadata says '{name}' has shape {list(shape)} but numel {n}")
    return fp


def _check_same_params(ref: Sequence[FlatParam], other: Sequence[FlatParam], ref_label: str, label: str) -> None:
    if len(ref) != len(other):
        raise ReshardError(f"{label}: shard_metadata lists {len(other)} flat parameters but {ref_label} lists "
                           f"{len(ref)}; the shards come from different models")
    for a, b in zip(ref, other):
        if a != b:
            field = next(f.name for f in fields(FlatParam) if getattr(a, f.name) != getattr(b, f.name))
            theirs, ours = (short_repr(getattr(fp, field), 80) for fp in (b, a))
            raise ReshardError(f"{label}: shard_metadata disagrees with {ref_label} on the {field} of flat parameter "
                               f"'{a.key}' ({theirs} vs {ours}); the shards come from different models or runs")


def _parse_ties(meta: ShardMetadata, flat_params: Sequence[FlatParam], label: str) -> tuple[tuple[str, str], ...]:
    """Tied (src, dst) from EVERY instance, made absolute with the instance's fsdp_path."""
    names = {n for fp in flat_params for n in fp.names}
    ties = []
    for inst in meta["param_metadata"]:
        path = clean_key(inst.get("fsdp_path", ""))
        for src, dst in inst.get("shared_param_info") or []:
            absolute = join_key(path, clean_key(src)) not in names and clean_key(src) in names
            src_full, dst_full = (join_key("" if absolute else path, clean_key(key)) for key in (src, dst))
            if src_full not in names:
                raise ReshardError(f"{label}: shared_param_info ties '{dst_full}' to '{src_full}', which no flat "
                                   "parameter holds")
            ties.append((src_full, dst_full))
    return tuple(ties)


def _aliases(models: Sequence[Mapping[str, Any]], key_maps: Sequence[Mapping[str, str]],
             flat_params: Sequence[FlatParam], unflattened: bool, ties: Sequence[tuple[str, str]]) -> tuple:
    """(src, dst) of each other model entry that views a parameter's tensor (one storage, offset, shape, stride) on
    every input: a parameter tied in an instance with flatten_parameters=False, which FSDP's local_state_dict holds
    under both names and shard_metadata lists once (with no shared_param_info), or such a tie consolidated (a
    flat parameter's cannot be written flat so: shared_param_info records those)."""
    params = [n for fp in flat_params if not fp.flattened for n in (fp.names if unflattened else (fp.key,))]
    taken = {*params, *(fp.key for fp in flat_params), *(dst for _, dst in ties)}
    views = [{_view(model[key_map[name]]): name for name in reversed(params)}  # the first name of a view
             for model, key_map in zip(models, key_maps)]
    found = []
    for key in (key for key in key_maps[0] if key not in taken):
        src = views[0].get(_view(models[0][key_maps[0][key]]))
        if src is not None and all(view.get(_view(model.get(key_map.get(key)))) == src
                                   for model, key_map, view in zip(models[1:], key_maps[1:], views[1:])):
            found.append((src, key))
    return tuple(found)


def _view(value: Any) -> tuple | None:
    return (id(value.storage), value.storage_offset, value.shape, value.stride) if is_tensor(value) else None


def _key_map(entries: Mapping[str, Any], label: str, where: str) -> dict[str, str]:
    """clean key -> actual key, tolerating `_fsdp_wrapped_module.` / `_fpw_module.` segments."""
    if not isinstance(entries, Mapping):  # a mirror, on an input other than 0
        kind = "tensor" if is_tensor(entries) else type(entries).__name__
        raise ReshardError(f"{label}: {where} is a {kind}, unlike input 0's dict laid out like model; the shards "
                           "come from different runs")
    key_map: dict[str, str] = {}
    for key in entries:
        clean = clean_key(str(key))
        if clean in key_map:
            raise ReshardError(f"{label}: {where} keys '{key_map[clean]}' and '{key}' both mean '{clean}'")
        key_map[clean] = key
    return key_map


def _is_unflattened(key_map: Mapping[str, str], model: Mapping[str, Any], flat_params: Sequence[FlatParam],
                    label: str) -> bool:
    has_flat = all(fp.key in key_map for fp in flat_params)
    has_names = all(n in key_map for fp in flat_params for n in fp.names)
    if not has_flat and not has_names:
        missing = next(fp for fp in flat_params if fp.key not in key_map)
        name = next((n for fp in (missing, *flat_params) for n in fp.names if n not in key_map), "?")  # its own first
        raise ReshardError(f"{label}: model has no '{missing.key}' (nor original parameter names such as '{name}'); "
                           "shard_metadata does not describe this model")
    # Keys of both kinds (a backing name can be an original name): unflattened unless every flat tensor is 1-D.
    return has_names and not (has_flat and all(_is_flat(model[key_map[fp.key]]) for fp in flat_params))


def check_flat_dtype(dtype: DType, first: DType, what: str, other: str, flat_key: str) -> None:
    """The tensors of one flat parameter (weights, or one optimizer moment) have one dtype: else they would be cast
    silently into the first one's. `what` and `other` name the two tensors."""
    if dtype != first:
        raise ReshardError(f"{what} is {dtype!r} but {other} is {first!r}; FSDP's flat parameter '{flat_key}' has "
                           "one dtype: save its tensors in one (e.g. .float() each)")


def _is_flat(value: Any) -> bool:
    return is_tensor(value) and value.dim() == 1


def missing_shards_hint(shards: Sequence[Mapping[str, Any]]) -> str:
    """Where the files' cfg says their save had more shards per model part than are given (the files saved by
    ranks, each saying its own): which seem missing, as a clause to add to an error; else ""."""
    cfgs = [s.get("cfg") for s in shards]
    world = cfg_value(cfgs[0], "distributed_training", "distributed_world_size")
    parts = cfg_value(cfgs[0], "common", "model_parallel_size")
    parts = parts if type(parts) is int and parts > 0 else 1
    ranks = [cfg_value(c, "distributed_training", "distributed_rank") for c in cfgs]
    if type(world) is not int or world // parts <= len(shards) or not all(type(r) is int for r in ranks) or (
            len(shards) > 1 and len(set(ranks)) == 1):  # files of other resharding tools all say rank 0's cfg
        return ""
    missing = sorted(set(range(world // parts)) - {r // parts for r in ranks})
    return (f"; their cfg says the save had {world // parts} shards per model part, so shard(s) "
            f"{', '.join(map(str, missing))} seem to be missing (a rank that failed to save, or a copy cut short?): "
            "use every file of one complete save")


def _flat_lengths(models: Sequence[Mapping[str, Any]], metas: Sequence[ShardMetadata],
                  key_maps: Sequence[Mapping[str, str]], flat_params: Sequence[FlatParam],
                  labels: Sequence[str]) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per flat parameter, its length with and without padding on every input, checked against shard_metadata."""
    padded, kept = [], []
    for fp in flat_params:
        lengths, keeps = [], []
        for model, meta, key_map, label in zip(models, metas, key_maps, labels):
            tensor = model[key_map[fp.key]]
            if not _is_flat(tensor):
                shape = list(tensor.shape) if is_tensor(tensor) else type(tensor).__name__
                raise ReshardError(f"{label}: model['{key_map[fp.key]}'] should be a 1-D flat tensor, found {shape}")
            length, pad = tensor.numel(), meta["param_metadata"][fp.instance]["params"][fp.backing_name]["padding"]
            if not isinstance(pad, int) or not 0 <= pad <= length:
                raise ReshardError(f"{label}: padding {pad!r} of '{fp.key}' is not between 0 and its {length} elements")
            if lengths and length != lengths[0]:
                raise ReshardError(f"{label}: flat parameter '{fp.key}' has {length} elements but {labels[0]} has "
                                   f"{lengths[0]}; every FSDP rank holds the same padded length")
            lengths.append(length)
            keeps.append(length - pad)
        _check_consumed(fp, keeps, labels)
        padded.append(tuple(lengths))
        kept.append(tuple(keeps))
    return tuple(padded), tuple(kept)


def _check_consumed(fp: FlatParam, keeps: Sequence[int], labels: Sequence[str]) -> None:
    """The unpadded lengths are FSDP's split of the parameters' (`shard_range`, whose lengths add up to numel); else
    the error names the first input whose length is not what the split gives it."""
    ranges = [shard_range(fp.numel, len(keeps), r) for r in range(len(keeps))]
    odd = next((r for r, (n, (a, b, _)) in enumerate(zip(keeps, ranges)) if n != b - a), None)
    if odd is None:
        return
    total = sum(keeps)
    if total == fp.numel:  # lengths of the split, but not at their ranks' places
        raise ReshardError(f"{labels[odd]}: holds {keeps[odd]} elements of flat parameter '{fp.key}' but FSDP gives "
                           f"shard {odd} of {len(keeps)} {ranges[odd][1] - ranges[odd][0]}: the files are not in the "
                           "order of the ranks that saved them (renamed?); each shardK must be rank K's file")
    detail = (f"consumed {total} of {fp.numel} elements" if total < fp.numel else
              f"{total - fp.numel} elements left over after consuming all {fp.numel}")
    raise ReshardError(f"{labels[odd]}: flat parameter '{fp.key}': the shards hold {total} elements after removing "
                       f"padding but shard_metadata numels add up to {fp.numel} ({detail}); {_COMPLETE}")


def _param_dict(layout: ModelLayout, dicts: Sequence[Mapping[str, Any]], maps: Sequence[Mapping[str, str]],
                root: tuple) -> ParamDict:
    """The flat parameters in `dicts` (one per input, laid out like `model` at `root`), each tensor checked
    against the layout's lengths (or shapes, unflattened), with input 0's other entries."""
    where = root[0] + "".join(f"['{key}']" for key in root[1:])
    sources, dtypes = [], []
    for k, fp in enumerate(layout.flat_params):
        spans, first = [], None
        for r, (entries, key_map, label) in enumerate(zip(dicts, maps, layout.labels)):
            pieces = [(n, s, s.numel()) for n, s in zip(fp.names, fp.shapes)] if layout.unflattened else [
                (fp.key, Size([layout.padded_lengths[k][r]]), layout.kept_lengths[k][r])]
            for key, shape, length in pieces:
                tensor = entries.get(key_map.get(key))
                if not is_tensor(tensor) or tensor.shape != shape:
                    found = list(tensor.shape) if is_tensor(tensor) else type(tensor).__name__
                    bad = _BAD_MODEL if root == ("model",) else _BAD_MIRROR
                    raise ReshardError(bad.format(label=label, where=where, key=key, found=found, shape=list(shape)))
                first = first or (tensor.dtype, label, f"{where}['{key}']")
                other = first[2] if first[1] == label else f"{first[1]}'s {first[2]}"
                check_flat_dtype(tensor.dtype, first[0], f"{label}: {where}['{key}']", other, fp.key)
                spans.append(Span(layout.first + r, (*root, key_map[key]), 0, length))
        sources.append(Spans(spans))
        # A flat parameter that holds no parameters has no elements: any tensor's dtype.
        dtypes.append(first[0] if first else next(v.dtype for v in dicts[0].values() if is_tensor(v)))
    aliases = _aliases(dicts, maps, layout.flat_params, layout.unflattened, layout.ties)
    taken = ({n for fp in layout.flat_params for n in fp.names} | {dst for _, dst in layout.ties} if layout.unflattened
             else {fp.key for fp in layout.flat_params}) | {dst for _, dst in aliases}
    values = {clean: (actual, dicts[0][actual]) for clean, actual in maps[0].items() if clean not in taken}
    extras = tuple(Extra(clean, actual, value.shape, value.dtype) if is_tensor(value) else
                   Extra(clean, actual, None, None) for clean, (actual, value) in values.items())
    return ParamDict(tuple(root), tuple(sources), tuple(dtypes), extras, aliases)
