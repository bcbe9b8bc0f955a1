"""Compare two checkpoints tensor by tensor, whatever their sharding (and model parts, merged).

A checkpoint (N flat FSDP shards, an unflattened file as `--unflatten-weights` writes,
or a plain state dict) is opened as a `TensorSet`: each original parameter, tensor
buffer and per-element optimizer state is an `OutTensor` planned by the reshard planner
itself (consolidation: `output_tensors` with unflatten), read on demand from the files.
Comparing two sets holds one tensor of each side at a time, so memory is about twice
the largest parameter, not the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import torch

from metaseq.errors import ReshardError, short_repr
from metaseq.file_io import model_part_number, summarize_paths
from metaseq.models.partition import rule_for
from metaseq.reshard.layout import all_ties, global_params
from metaseq.reshard.optim import differing_settings, optimizer_settings
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.plan import (InputFile, Source, analyze_inputs, cut_model_parallel, output_tensors, read_inputs,
                                  tensor_ref, whole_tensor)
from metaseq.reshard.ranges import OutTensor
from metaseq.reshard.schema import OPTIM, cfg_value, clean_key, is_tensor, resolve
from metaseq.torchzip import Opaque, pickle_bytes, to_torch

__all__ = ["Comparison", "Difference", "TensorSet", "compare_tensor_sets", "describe_comparison", "open_model_parts",
           "open_tensor_set", "tensor_difference", "tensor_set_from_source"]

CHUNK_ELEMENTS = 1 << 24  # differences are computed in chunks of this many elements
OptimKey = str  # "STATE of PARAMETER", e.g. "exp_avg of decoder.x.weight"


@dataclass(frozen=True)
class TensorSet:
    """The named tensors of one checkpoint, in unflattened form, read on demand."""

    inputs: tuple[InputFile, ...]
    form: str  # for reports: "4 flat shards", "1 unflattened file", "a plain state dict"
    model: dict[str, OutTensor]  # original parameter names (tied ones included) and tensor buffers
    buffers: frozenset[str]
    optim: dict[OptimKey, OutTensor] | None  # None: no optimizer state, skipped, or not comparable
    optim_scalars: dict[OptimKey, Any]  # e.g. step, as a plain number
    optim_settings: dict[str, Any]  # param_groups without their "params" ids, loss_scale, ...
    scales: dict[tuple, list[float]]  # by path, per input: fp16 moment x scale = value
    note: str = ""  # why optimizer state cannot be compared, if so

    def read(self, tensor: OutTensor) -> torch.Tensor:
        """The tensor; moments stored with a per-rank scale (--fp16-adam-stats) as their values."""
        out = to_torch(tensor_ref(tensor, self.inputs))
        factors = self.scales.get(tensor.path)
        if factors is None:
            return out
        flat = out.float().reshape(-1)
        for run in tensor.runs:
            flat.as_strided((run.count, run.length), (run.pitch or run.length, 1), run.offset).mul_(factors[run.input])
        return flat.view(out.shape)


def open_tensor_set(paths: Sequence[str], *, trust: bool = False, skip_optimizer_state: bool = False) -> TensorSet:
    """Validate and open the files of one checkpoint (ordered by shard index); reads only pickles."""
    inputs = read_inputs(paths, trust=trust)
    first = inputs[0].structure
    flat = isinstance(first.get("model"), Mapping) and any("flat_param_" in str(k) for k in first["model"])
    if len(paths) == 1 and "shard_metadata" not in first and not flat:  # flat: analyze_inputs says what is missing
        return _plain_tensor_set(inputs[0], skip_optimizer_state)
    options = ReshardOptions(skip_optimizer_state=skip_optimizer_state)
    found = tensor_set_from_source(analyze_inputs([i.structure for i in inputs], list(paths), options), inputs)
    parts, rank = (cfg_value(first.get("cfg"), *key) for key in (("common", "model_parallel_size"),
                                                                 ("distributed_training", "distributed_rank")))
    if type(parts) is int and parts > 1:  # one part alone holds a slice of each cut weight
        part = model_part_number(paths[0])  # else shard i of part j is rank i * parts + j
        part = rank % parts if part is None and type(rank) is int else part
        found = replace(found, form=f"model part {'?' if part is None else part} of {parts}: {found.form}")
    return replace(found, model={**found.model, **_differing_buffers(found)})


def _differing_buffers(found: TensorSet) -> dict[str, OutTensor]:
    """Each other input's copy of a buffer (every FSDP rank saves it whole) that differs from input 0's, as
    "NAME (FILE's copy, unlike FILE0's)": what a reshard, which keeps input 0's, drops."""
    differing, inputs = {}, found.inputs
    for name in sorted(found.buffers):
        first = found.model[name]
        ours = found.read(first)
        for r, item in enumerate(inputs[1:], start=1):
            theirs = first._replace(runs=tuple(run._replace(input=r) for run in first.runs))
            try:
                value = resolve(item.structure, first.runs[0].path) if first.runs else None
            except (KeyError, TypeError):
                value = None
            if not is_tensor(value) or value.shape != first.shape:
                continue  # a copy that is not there, or not like input 0's, is not a copy
            if tensor_difference(found.read(theirs), ours) is not None:
                differing[f"{name} ({item.path}'s copy, unlike {inputs[0].path}'s)"] = theirs
    return differing


def open_model_parts(groups: Sequence[Sequence[str]], *, trust: bool = False,
                     skip_optimizer_state: bool = False) -> TensorSet:
    """The files of P model parts (each part's shards, ordered) as one model: each cut parameter merged, each
    replicated tensor or optimizer scalar part 0's, and each part's copy that differs from part 0's, under
    "NAME (model part p's copy, unlike part 0's)": what a merge would drop, so that a comparison sees it."""
    inputs = read_inputs([path for group in groups for path in group], trust=trust)
    options = ReshardOptions(unflatten_weights=True, skip_optimizer_state=skip_optimizer_state)
    counts = (1, len(groups)) if len(groups) > 1 else (1,)  # merged, and (with parts) each part as it is
    (whole,), *kept = cut_model_parallel(inputs, groups, options, counts, flag="pattern")
    merged = tensor_set_from_source(whole, inputs, stored_ties=False)
    each = "1 unflattened file" if merged.form == "1 unflattened file" else f"{len(groups[0])} flat shard(s)"
    model, optim, scalars = _differing_copies([tensor_set_from_source(source, inputs, stored_ties=False)
                                               for source in kept[0]]) if kept else ({}, {}, {})
    return replace(merged, form=f"{len(groups)} model parts of {each}", model={**merged.model, **model},
                   optim=None if merged.optim is None else {**merged.optim, **optim},
                   optim_scalars={**merged.optim_scalars, **scalars})


def _differing_copies(own: Sequence[TensorSet]) -> tuple[dict, dict, dict]:
    """The model tensors, optimizer tensors and optimizer scalars of parts 1, 2, ... (each part's own replicated
    ones) that differ from part 0's, as "NAME (model part p's copy, unlike part 0's)"; part 0's read once."""
    found: tuple[dict, dict, dict] = ({}, {}, {})
    for table, which in zip(found, ("model", "optim")):
        for key, tensor in (getattr(own[0], which) or {}).items():
            if rule_for(key.split(" of ")[-1]) is not None:  # a cut parameter's: each part holds another slice
                continue
            first = own[0].read(tensor)
            for p, part in enumerate(own[1:], start=1):
                theirs = getattr(part, which)[key]
                if tensor_difference(part.read(theirs), first) is not None:
                    table[f"{key} (model part {p}'s copy, unlike part 0's)"] = theirs
    for p, part in enumerate(own[1:], start=1):
        found[2].update((f"{key} (model part {p}'s copy, unlike part 0's)", value)
                        for key, value in part.optim_scalars.items()
                        if not _same_value(value, own[0].optim_scalars[key]))
    return found


def tensor_set_from_source(source: Source, inputs: Sequence[InputFile], output_dtype: str | None = None, *,
                           stored_ties: bool = True) -> TensorSet:
    """Every tensor of an analyzed checkpoint as a consolidation (with `--output-dtype`) would write it; a tied copy
    an unflattened input stores under its own name is read there, unless not `stored_ties` (a model-parallel cut:
    the input holds another part's slice)."""
    layout, shard0 = source.model, inputs[0].structure
    names = {g: layout.flat_params[k].names[j] for g, k, j in global_params(layout)}
    options = ReshardOptions(unflatten_weights=True, output_dtype=output_dtype)
    targets = output_tensors(source, options, 0)
    # paths ("model", NAME), EMA's ("extra_state", "ema", NAME) compared like parameters, (OPTIM, "state", g, STATE)
    model = {".".join(t.path).removeprefix("model."): t for t in targets if t.path[0] != OPTIM}
    optim = {f"{t.path[3]} of {names[t.path[2]]}": t for t in targets if t.path[0] == OPTIM}
    stored = ({clean_key(str(k)): k for k, v in shard0["model"].items() if is_tensor(v)}
              if layout.unflattened and stored_ties else {})
    for src, dst in all_ties(layout):  # an unflattened file stores each tied copy under its own name: read that
        if dst in stored:
            tensor = shard0["model"][stored[dst]]
            model[dst] = whole_tensor(("model", dst), ("model", stored[dst]), tensor.shape, tensor.dtype, options.dtype)
        else:
            model[dst] = model[src]._replace(path=("model", dst))
    buffers = frozenset(e.key for e in layout.dicts[0].extras if e.shape is not None)
    form = "1 unflattened file" if layout.unflattened else f"{len(inputs)} flat shard{'s' * (len(inputs) > 1)}"
    extras = ({}, {}, {}) if source.optim is None else _optim_extras(source, names, inputs)
    return TensorSet(tuple(inputs), form, model, buffers, None if source.optim is None else optim, *extras)


def _optim_extras(source: Source, names: Mapping[int, str], inputs: Sequence[InputFile]) -> tuple[dict, dict, dict]:
    """Optimizer scalars, settings (input 0's, and each other input's that differ, which a reshard would drop, as
    "SETTING (FILE's, unlike FILE0's)"), and per-input scales of states with a `NAME_scale` (--fp16-adam-stats)."""
    scalars, scales = {}, {}
    for g, k, _ in global_params(source.model):
        entries = {e.name: e for e in source.optim.entries.get(k, ())}
        for name, entry in entries.items():
            scale = entries.get(f"{name}_scale")
            if entry.segments is None:
                scalars[f"{name} of {names[g]}"] = _plain_scalar(entry.values[0])
            elif scale is not None and len(scale.values) == len(source.model.labels):
                scales[(OPTIM, "state", g, name)] = [v.value() if is_tensor(v) else float(v) for v in scale.values]
    osd0, labels = inputs[0].structure[OPTIM], source.model.labels
    settings = optimizer_settings(osd0)
    for item, label in zip(inputs[1:], labels[1:]):
        settings.update((f"{name} ({label}'s, unlike {labels[0]}'s)", value)
                        for name, value, _ in differing_settings(osd0, item.structure[OPTIM]))
    return scalars, to_torch(settings), scales


def _plain_scalar(value: Any) -> Any:
    """`step` as saved flat (0-dim tensor or int) or consolidated (number, per-rank list) -> a number."""
    value = value[0] if isinstance(value, list) and value else value
    return to_torch(value).squeeze().tolist() if is_tensor(value) else value


def _plain_tensor_set(item: InputFile, skip_optimizer_state: bool) -> TensorSet:
    """A file without shard_metadata: `model` (or the whole dict) holds named tensors."""
    structure, path = item.structure, item.path
    state_dict, prefix = structure.get("model"), ("model",)
    if not isinstance(state_dict, Mapping):
        state_dict, prefix = structure, ()
    tensors = [is_tensor(v) for v in state_dict.values()]
    if not any(tensors) or not prefix and not all(tensors):  # a whole dict of tensors, or `model` with some
        raise ReshardError(f"{path}: neither FSDP shards nor a state dict (no 'model' dict of tensors)")
    model = {}
    for key, value in ((k, v) for k, v in state_dict.items() if is_tensor(v)):
        if not value.is_contiguous():
            raise ReshardError(f"{path}: model['{key}'] is a non-contiguous view; cannot compare it")
        name = clean_key(str(key))
        model[name] = whole_tensor(("model", name), (*prefix, key), value.shape, value.dtype)
    head, embedding = "decoder.output_projection.weight", "decoder.embed_tokens.weight"
    if embedding in model and head not in model:  # upstream's restored.pt: the tied head is left out
        model[head] = model[embedding]._replace(path=("model", head))
    note = ""
    if structure.get(OPTIM) is not None and not skip_optimizer_state:
        note = f"{path} has no shard_metadata, so its optimizer state ids cannot be matched to parameter names"
    return TensorSet((item,), "a plain state dict", model, frozenset(), None, {}, {}, {}, note)


@dataclass(frozen=True)
class Difference:
    name: str  # a parameter, "optimizer exp_avg of <parameter>", or "optimizer <setting>"
    detail: str  # "max abs diff 0.25", "only in A", "shape [3] vs [4]", ...


@dataclass
class Comparison:
    model_tensors: int = 0  # compared on both sides
    optimizer_tensors: int = 0
    optimizer_scalars: int = 0
    optimizer_compared: bool = False
    differences: list[Difference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences


def compare_tensor_sets(a: TensorSet, b: TensorSet, *, atol: float = 0.0, exact_dtype: bool = False) -> Comparison:
    """Compare every tensor by name, one pair in memory at a time.

    Values are equal when their max abs difference is at most `atol` (NaN equals only
    NaN); with `exact_dtype` they must also have the same dtype and identical bits.
    Optimizer state is compared only when both sides have it (a note says otherwise).
    """
    result = Comparison()
    result.model_tensors = _compare_tensors(a, b, "model", result, atol, exact_dtype)
    if a.optim is None or b.optim is None:
        result.notes += [s.note for s in (a, b) if s.note]
        if (a.optim is None) != (b.optim is None) and not any(s.note for s in (a, b)):
            result.notes.append(f"optimizer state only in {'A' if b.optim is None else 'B'}; not compared")
        return result
    result.optimizer_compared = True
    result.optimizer_tensors = _compare_tensors(a, b, "optim", result, atol, exact_dtype)
    result.optimizer_scalars = _compare_optim_values(a.optim_scalars, b.optim_scalars, result)
    _compare_optim_values(a.optim_settings, b.optim_settings, result)
    return result


def _common(va: Mapping[str, Any], vb: Mapping[str, Any], prefix: str, result: Comparison) -> list[str]:
    """The keys on both sides; each key on one side only is a difference."""
    result.differences += [Difference(f"{prefix}{k}", "only in A") for k in va if k not in vb]
    result.differences += [Difference(f"{prefix}{k}", "only in B") for k in vb if k not in va]
    return [k for k in va if k in vb]


def _compare_tensors(a: TensorSet, b: TensorSet, which: str, result: Comparison, atol: float, exact_dtype: bool) -> int:
    """The tensors of `which` ("model" or "optim"); returns how many had the same shape on both sides."""
    ta, tb, prefix = getattr(a, which), getattr(b, which), "optimizer " if which == "optim" else ""
    # what one side may leave out: upstream's restored.pt has no version buffer and no EMA
    for part in ("decoder.version", "extra_state.ema", "extra_state.ema_fp32_params") if which == "model" else ():
        held = [any(k == part or k.startswith(part + ".") for k in t) for t in (ta, tb)]
        if held[0] != held[1]:
            result.notes.append(f"{part} only in {'AB'[held[1]]}; not compared")
            ta, tb = ({k: v for k, v in t.items() if k != part and not k.startswith(part + ".")} for t in (ta, tb))
    compared, dtypes = 0, set()
    for key in _common(ta, tb, prefix, result):
        x, y = ta[key], tb[key]
        if x.shape != y.shape:
            result.differences.append(Difference(f"{prefix}{key}", f"shape {list(x.shape)} vs {list(y.shape)}"))
            continue
        if x.dtype != y.dtype:
            dtypes.add((x.dtype, y.dtype))
        detail = tensor_difference(a.read(x), b.read(y), atol=atol, exact_dtype=exact_dtype)
        if detail is not None:
            result.differences.append(Difference(f"{prefix}{key}", detail))
        compared += 1
    for x, y in sorted(dtypes, key=str):
        result.notes.append(f"some tensors are {_dtype(x)} in A and {_dtype(y)} in B; their values were compared")
    return compared


def _compare_optim_values(va: Mapping[str, Any], vb: Mapping[str, Any], result: Comparison) -> int:
    common = _common(va, vb, "optimizer ", result)
    for key in (k for k in common if not _same_value(va[k], vb[k])):
        name, x, y = f"optimizer {key}", va[key], vb[key]
        if key == "param_groups" and len(x) == len(y) and all(isinstance(g, Mapping) for g in (*x, *y)):
            # each differing setting by group, not the whole list
            for i, (gx, gy) in enumerate(zip(x, y)):
                for k in (k for k in {**gx, **gy} if not _same_value(gx.get(k, "(none)"), gy.get(k, "(none)"))):
                    shown = " vs ".join(short_repr(g.get(k, "(none)"), 60) for g in (gx, gy))
                    result.differences.append(Difference(f"{name}[{i}]['{k}']", shown))
            continue
        result.differences.append(Difference(name, " vs ".join(short_repr(value, 60) for value in (x, y))))
    return len(common)


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:
        return True  # NaN, bit patterns aside
    if any(isinstance(v, Opaque) or isinstance(v, type) and issubclass(v, Opaque) for v in (x, y)):
        return pickle_bytes(x) == pickle_bytes(y)  # carried objects and globals: by what unpickling them would do
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and bool(torch.equal(x, y) or (
            x.dtype.is_floating_point and y.dtype.is_floating_point and torch.equal(x.isnan(), y.isnan())
            and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))))  # NaN where the other has NaN
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        if x.keys() == y.keys():
            return all(_same_value(x[k], y[k]) for k in x)
        return _same_value(list(x), list(y)) and _same_value(list(x.values()), list(y.values()))
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_value(i, j) for i, j in zip(x, y))
    return bool(x == y)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_difference(x: torch.Tensor, y: torch.Tensor, *, atol: float = 0.0, exact_dtype: bool = False) -> str | None:
    """None when equal (see `compare_tensor_sets`), else what differs, e.g. "max abs diff 0.25"."""
    if exact_dtype and x.dtype != y.dtype:
        return f"dtype {_dtype(x.dtype)} vs {_dtype(y.dtype)}"
    if x.shape != y.shape:
        return f"shape {list(x.shape)} vs {list(y.shape)}"
    if x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
        return None  # bit for bit: NaN payloads and -0.0 too
    diff = max_abs_diff(x, y)
    if not exact_dtype and diff <= atol:
        return None
    return f"max abs diff {diff:.6g}" + (" (same values, different bits)" if diff == 0 else "")


def max_abs_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| chunk by chunk, exactly in int64 for two integer tensors, else in float64 (where equal infinities
    and NaN against NaN count as 0)."""
    integers = not (x.dtype.is_floating_point or y.dtype.is_floating_point)  # float64 cannot tell 2**53 + 1 apart
    worst = torch.zeros((), dtype=torch.float64)
    for dx, dy in zip(x.reshape(-1).split(CHUNK_ELEMENTS), y.reshape(-1).split(CHUNK_ELEMENTS)):
        if integers:
            dx, dy = dx.long(), dy.long()
            gap = torch.where(dx > dy, dx - dy, dy - dx).double()
            gap += (gap < 0) * 2.0**64  # a gap beyond int64 wrapped around
        else:
            dx, dy = dx.double(), dy.double()
            gap = torch.where((dx == dy) | (dx.isnan() & dy.isnan()), 0.0, (dx - dy).abs())
        if gap.numel():
            worst = torch.maximum(worst, gap.max())  # NaN propagates
    return worst.item()


def describe_comparison(comparison: Comparison, a: TensorSet, b: TensorSet) -> list[str]:
    """The report `compare_checkpoints` prints: what was compared, each difference, the verdict."""
    lines = [f"{side}: {checkpoint.form}: {summarize_paths([i.path for i in checkpoint.inputs], 2)}"
             for side, checkpoint in (("A", a), ("B", b))]
    lines.append(f"compared {comparison.model_tensors} model tensors")
    if comparison.optimizer_compared:
        lines[-1] += f", {comparison.optimizer_tensors} optimizer tensors"
        lines[-1] += f" and {comparison.optimizer_scalars} optimizer scalars"
    lines.append("note: cfg, optimizer_history (update count, LR scheduler) and extra_state but EMA (data position, "
                 "metrics, RNG states) are not compared")
    parts = [side for side, checkpoint in (("A", a), ("B", b)) if checkpoint.form.startswith("model part ")]
    if parts:
        held = "A and B each hold" if len(parts) == 2 else f"{parts[0]} holds"
        lines.append(f"note: {held} one model part: the other parts are not compared; give every part's files "
                     "(a glob over 'model_part-*') to compare whole models")
    lines += [f"note: {note}" for note in comparison.notes]
    lines += [f"differs: {d.name}: {d.detail}" for d in comparison.differences]
    same = ("SAME: the checkpoints hold the same model" + " part" * bool(parts)
            + " and optimizer state" * comparison.optimizer_compared)
    return lines + [same if comparison.equal else f"DIFFERENT: {len(comparison.differences)} difference(s)"]
