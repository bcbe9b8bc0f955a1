"""Model-parallel resharding: the same global tensors cut into Q model parts instead of P.

A parameter that `metaseq.models.partition.RULES` cuts is, across the P input parts,
one global tensor; output part q's slice of it is a list of element pieces of the input
parts' slices. So every output part gets a layout whose flat parameters' `Span`s point
into the input files, like any FSDP input, and `plan.output_tensors` shards or
unflattens it as always. Pure, but for reading replicated tensors to warn when parts differ.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

from metaseq.errors import ReshardError
from metaseq.models.partition import Rule, rule_for
from metaseq.reshard.layout import FlatParam, ModelLayout
from metaseq.reshard.optim import OptimLayout, StateEntry, scalar_key
from metaseq.reshard.ranges import Span, Spans, join_spans, side_by_side
from metaseq.reshard.schema import resolve
from metaseq.torchzip import DType, Size

__all__ = ["check_parts_fit", "cut_model_parts", "global_shapes"]

logger = logging.getLogger(__name__)


def global_shapes(parts: Sequence[ModelLayout]) -> dict[str, Size]:
    """Every parameter's global shape, checked: cut parameters alike in every part, replicated ones equal."""
    first = parts[0]
    for p, part in enumerate(parts[1:], start=1):
        if [(fp.key, fp.names) for fp in part.flat_params] != [(fp.key, fp.names) for fp in first.flat_params]:
            raise ReshardError(f"{part.labels[0]}: model part {p} has other parameters than part 0 "
                               f"({first.labels[0]}); the parts come from different models")
    shapes = {}
    for k, fp in enumerate(first.flat_params):
        for j, name in enumerate(fp.names):
            local = [part.flat_params[k].shapes[j] for part in parts]
            if len(set(local)) > 1:
                raise ReshardError(f"{name}: its shape differs between model parts ({[list(s) for s in local]}); "
                                   "every part holds an equal slice, so the parts come from different models")
            rule, shape = rule_for(name), list(local[0])
            if rule is not None:
                if rule.dim >= len(shape):
                    raise ReshardError(f"{name}: shape {shape} has no dim {rule.dim} to cut, as its rule says; "
                                       "the partition rules (metaseq.models.partition) are for metaseq's "
                                       "OPT-style model, which this is not")
                shape[rule.dim] *= len(parts)
            shapes[name] = Size(shape)
    return shapes


def check_parts_fit(shapes: dict[str, Size], num_parts: int, heads: int | None) -> None:
    """Refuse a number of output parts that does not divide what each part must hold equally, naming those that do."""
    cut = [(name, shape[rule.dim] // rule.blocks, rule) for name, shape in shapes.items()
           if (rule := rule_for(name)) is not None]  # per cut tensor: the size of each of its blocks
    fits = [q for q in range(1, 65) if (heads is None or heads % q == 0) and all(size % q == 0 for _, size, _ in cut)]
    which = "--num-output-parts " + ", ".join(map(str, fits))
    if heads is not None and heads % num_parts:
        raise ReshardError(f"--num-output-parts={num_parts} does not divide the {heads} attention heads in "
                           f"cfg['model']['decoder_attention_heads']; {which} would")
    for name, size, rule in cut:
        if size % num_parts:
            per = f" in each of its {rule.blocks} blocks" if rule.blocks > 1 else ""
            raise ReshardError(f"--num-output-parts={num_parts} does not divide the {size} {rule.what} of "
                               f"{name}{per}; {which} would")


def cut_model_parts(parts: Sequence[ModelLayout], optims: Sequence[OptimLayout | None], shapes: dict[str, Size],
                    num_parts: int, part: int, structures: Sequence[Any]) -> tuple[ModelLayout, OptimLayout | None]:
    """Output part `part` of `num_parts`: its layout (local shapes, spans into the inputs) and optimizer state.
    `shapes` are the parts' `global_shapes`; `structures` the inputs' objects, to compare replicated tensors. With
    as many parts as the inputs, part j is input part j: its replicated tensors, scalars and other objects."""
    cut, first = _Cutter(parts, shapes, num_parts, part, structures), parts[0]
    own = cut.own or 0  # the input part whose objects this part keeps
    model = dataclasses.replace(
        first, labels=tuple(label for p in parts for label in p.labels),
        flat_params=tuple(cut.flat_param(fp) for fp in first.flat_params), first=parts[own].first,
        dicts=tuple(dataclasses.replace(d, sources=tuple(cut.spans(k, [p.dicts[i].sources[k] for p in parts])
                                                         for k in range(len(d.sources))))
                    for i, d in enumerate(first.dicts)),
    )
    if optims[0] is None:
        return model, None
    entries = {k: tuple(cut.entry(k, [o.entries[k][i] for o in optims]) for i in range(len(e)))
               for k, e in optims[0].entries.items()}
    return model, dataclasses.replace(optims[own], entries=entries)


class _Cutter:
    """Spans of output part `part`'s flat parameters, from the input parts' spans of theirs."""

    def __init__(self, parts: Sequence[ModelLayout], shapes: dict[str, Size], num_parts: int, part: int,
                 structures: Sequence[Any]) -> None:
        self.parts, self.shapes, self.num_parts, self.part = parts, shapes, num_parts, part
        self.structures, self.warned, self.own = structures, set(), part if num_parts == len(parts) else None

    def flat_param(self, fp: FlatParam) -> FlatParam:
        """`fp` with the local shapes of this part's parameters."""
        shapes = [list(self.shapes[name]) for name in fp.names]
        for name, shape in zip(fp.names, shapes):
            rule = rule_for(name)
            if rule is not None:
                shape[rule.dim] //= self.num_parts
        return dataclasses.replace(fp, shapes=tuple(map(Size, shapes)))

    def spans(self, k: int, part_spans: Sequence[Spans], what: str = "") -> Spans:
        """Output flat parameter k's elements (or `what`, e.g. "exp_avg of ", its state's): each of its parameters'
        pieces of the input parts, in order."""
        out = []
        ranges = zip(*(p.flat_params[k].ranges for p in self.parts))  # per parameter: (start, end) per part
        for name, starts_ends in zip(self.parts[0].flat_params[k].names, ranges):
            rule = rule_for(name)
            if rule is None:
                copies = [index.slice(start, end) for index, (start, end) in zip(part_spans, starts_ends)]
                if self.own is None:
                    self._warn_if_parts_differ(what + name, copies)
                out += copies[self.own or 0]
                continue
            columns, count, stride = _pieces(self.shapes[name], rule, len(self.parts), self.num_parts, self.part)
            out += side_by_side([part_spans[p].slice_rows(starts_ends[p][0] + offset, length, count, stride)
                                 for p, offset, length in columns])
        return join_spans(out)

    def entry(self, k: int, entries: Sequence[StateEntry]) -> StateEntry:
        """An optimizer state of flat parameter k: per-element ones cut like the parameter, scalars part 0's (or
        the output part's own)."""
        names = {e.name for e in entries}
        if len(names) > 1:
            raise ReshardError(f"last_optimizer_state of flat parameter {k} holds {sorted(names)} in different "
                               "model parts; the parts come from different runs")
        if entries[0].segments is None:
            if self.own is not None:
                return entries[self.own]
            if dataclasses.replace(entries[0], values=tuple(v for e in entries for v in e.values)).per_rank:
                raise ReshardError(f"last_optimizer_state.state[{k}]['{entries[0].name}'] differs between ranks or "
                                   "model parts: per-rank state (such as --fp16-adam-stats scales) belongs to the "
                                   f"elements each holds, which move with --num-output-parts={self.num_parts}; keep "
                                   f"{len(self.parts)} parts or pass --skip-optimizer-state")
            others = [p for p, e in enumerate(entries) if scalar_key(e.values[0]) != scalar_key(entries[0].values[0])]
            if others and not self.part and (k, entries[0].name) not in self.warned:  # once per run, by part 0
                self.warned.add((k, entries[0].name))
                logger.warning("last_optimizer_state.state[%d]['%s'] differs between parts (part %d vs part 0); using "
                               "part 0's", k, entries[0].name, others[0])
            return entries[0]
        return dataclasses.replace(entries[0], segments=self.spans(k, [e.segments for e in entries],
                                                                   f"{entries[0].name} of "))

    def _warn_if_parts_differ(self, name: str, copies: Sequence[Sequence[Span]]) -> None:
        """A replicated tensor should be equal in every part: part 0's is used, a difference is reported."""
        if name in self.warned or self.part or len(copies) < 2:  # once per run: by output part 0
            return
        (first, dtype), *others = (_read(self.structures, spans) for spans in copies)
        for p, (data, _) in enumerate(others, start=1):
            if data != first:
                self.warned.add(name)
                logger.warning("%s differs between parts (max diff %s, part %d vs part 0); using part 0", name,
                               _max_diff(first, data, dtype), p)
                return


def _pieces(shape: Size, rule: Rule, in_parts: int, out_parts: int,
            part: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """Output part `part`'s slice as (columns, count, stride): `count` rows, each the columns'
    pieces side by side; a column is (input part, element offset in its slice, length), and
    moves `stride` elements per row there.

    Along `rule.dim` the global tensor holds `rule.blocks` equal blocks; input part p holds
    the p-th of `in_parts` equal slices of each block, output part q the q-th of `out_parts`.
    """
    outer = math.prod(shape[: rule.dim])
    inner = math.prod(shape[rule.dim + 1 :])
    block = shape[rule.dim] // rule.blocks
    in_len, out_len = block // in_parts, block // out_parts
    stride = rule.blocks * in_len * inner
    if 0 < in_len == out_len:  # whole rows of one part: one block of elements
        return [(part, 0, stride * outer)], 1, 0
    columns: list[tuple[int, int, int]] = []  # none continues the one before: pieces of a block are of different parts
    for b in range(rule.blocks):
        row, end = part * out_len, (part + 1) * out_len  # rows of the block
        while row < end:
            p, local = divmod(row, in_len)
            stop = min(end, (p + 1) * in_len)
            columns.append((p, (b * in_len + local) * inner, (stop - row) * inner))
            row = stop
    return columns, outer, stride


def _read(structures: Sequence[Any], spans: Sequence[Span]) -> tuple[bytes, DType | None]:
    """The bytes of a (small, replicated) tensor's elements, and their dtype."""
    out, dtype = [], None
    for span in spans:
        tensor = resolve(structures[span.input], span.path)
        dtype, size = tensor.dtype, tensor.dtype.itemsize
        out.append(tensor.storage.read((tensor.storage_offset + span.start) * size, span.length * size))
    return b"".join(out), dtype


def _max_diff(a: bytes, b: bytes, dtype: DType) -> str:
    """max |a - b| of two tensors' (different, so not empty) bytes, as text ("?" for dtypes that are not floats)."""
    import torch

    if not dtype.is_floating_point:
        return "?"
    x, y = (torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype.name)).double() for data in (a, b))
    return f"{(x - y).abs().max().item():.3g}"
