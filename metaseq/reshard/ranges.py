"""Element ranges: how FSDP splits a flat parameter, and the runs of input elements that fill an output.

A tensor's elements are counted in row-major order. Where they come from is a list of
`Span`s laid end to end, each a stretch of one input tensor; the part of it an output
needs is a list of `Run`s, each copied as one block of bytes. Nothing here does I/O.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any, NamedTuple, Sequence

from metaseq.torchzip import DType, Size

__all__ = ["OutTensor", "Run", "Span", "SpanIndex", "join_spans", "plan_range", "shard_range", "sub_spans"]


class Span(NamedTuple):
    """`length` elements of input `input`'s tensor at `path`, from its element `start`."""

    input: int  # index into the plan's inputs
    path: tuple[Any, ...]  # keys from the input's dict down to the tensor
    start: int
    length: int


class Run(NamedTuple):
    """Copy `length` elements of input `input`'s tensor at `path`, from its element `start`,
    to element `offset` of the output tensor."""

    input: int
    path: tuple[Any, ...]
    start: int
    offset: int
    length: int


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded_len) of `rank`'s slice of an unpadded flat parameter.

    Matches fairscale's `_get_shard` (torch.chunk): every rank holds
    padded_len = ceil(numel / world_size) elements, rank r keeps
    full[r * padded_len : (r + 1) * padded_len] and pads the rest with zeros, so
    trailing ranks may be partly or entirely padding.
    """
    assert world_size >= 1 and 0 <= rank < world_size, (world_size, rank)
    padded_len = -(-numel // world_size)
    start = min(rank * padded_len, numel)
    end = min(start + padded_len, numel)
    return start, end, padded_len


def plan_range(spans: Sequence[Span], start: int, end: int, offset: int = 0) -> tuple[Run, ...]:
    """Runs that copy elements [start, end) of the spans laid end to end, to output elements from `offset`."""
    starts = list(itertools.accumulate((s.length for s in spans), initial=0))
    assert start >= end or starts[-1] >= end, f"range [{start}, {end}) beyond the {starts[-1]} source elements"
    runs = []
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(spans) and starts[i] < end:
        span = spans[i]
        lo, hi = max(start, starts[i]), min(end, starts[i + 1])
        if lo < hi:
            runs.append(Run(span.input, span.path, span.start + lo - starts[i], offset + lo - start, hi - lo))
        i += 1
    return tuple(runs)


def sub_spans(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    """The spans of elements [start, end) of `spans` laid end to end."""
    return SpanIndex(spans).slice(start, end)


class SpanIndex:
    """Spans laid end to end, sliced many times (a model-parallel cut takes one slice per row)."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = list(spans)
        self.starts = list(itertools.accumulate((s.length for s in self.spans), initial=0))

    def slice(self, start: int, end: int) -> list[Span]:
        """The spans of elements [start, end)."""
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            span, first = self.spans[i], self.starts[i]
            take = min(end, first + span.length) - start
            if take > 0:
                out.append(Span(span.input, span.path, span.start + start - first, take))
                start += take
            i += 1
        return out


def join_spans(spans: Sequence[Span]) -> tuple[Span, ...]:
    """The same elements with neighbours that continue each other in one input tensor merged."""
    out: list[Span] = []
    for span in spans:
        last = out[-1] if out else None
        if last is not None and (last.input, last.path, last.start + last.length) == (span.input, span.path, span.start):
            out[-1] = last._replace(length=last.length + span.length)
        elif span.length:
            out.append(span)
    return tuple(out)


class OutTensor(NamedTuple):
    """One output tensor: `shape` and `dtype`, zeros except what `runs` copy in (the rest is padding)."""

    path: tuple[Any, ...]  # keys in the output's dict
    shape: Size
    dtype: DType
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize
