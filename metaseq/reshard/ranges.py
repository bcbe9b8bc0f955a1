"""Element ranges: how FSDP splits a flat parameter, and the runs of input elements that fill an output.

A tensor's elements are counted in row-major order. Where they come from is a list of
`Span`s laid end to end, each a stretch of one input tensor; the part of it an output
needs is a list of `Run`s, each copied as one block of bytes. A span or run may repeat:
`count` blocks of `length` elements, `stride` elements apart in the input and end to end
in the output (the rows of a weight that model parallelism cuts on its second dim).
Nothing here does I/O.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any, NamedTuple, Sequence

from metaseq.torchzip import DType, Size

__all__ = ["OutTensor", "Run", "Span", "SpanIndex", "join_spans", "plan_range", "shard_range", "sub_spans"]


class Span(NamedTuple):
    """`length` elements of input `input`'s tensor at `path`, from its element `start` (`count` times,
    `stride` elements apart in the input: `length * count` elements of the output)."""

    input: int  # index into the plan's inputs
    path: tuple[Any, ...]  # keys from the input's dict down to the tensor
    start: int
    length: int
    count: int = 1
    stride: int = 0

    @property
    def size(self) -> int:
        return self.length * self.count


class Run(NamedTuple):
    """Copy `length` elements of input `input`'s tensor at `path`, from its element `start`,
    to element `offset` of the output tensor (`count` times: input `stride` apart, output end to end)."""

    input: int
    path: tuple[Any, ...]
    start: int
    offset: int
    length: int
    count: int = 1
    stride: int = 0


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
    runs = []
    for span in SpanIndex(spans).slice(start, end):
        runs.append(Run(span.input, span.path, span.start, offset, span.length, span.count, span.stride))
        offset += span.size
    return tuple(runs)


def sub_spans(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    """The spans of elements [start, end) of `spans` laid end to end."""
    return SpanIndex(spans).slice(start, end)


class SpanIndex:
    """Spans laid end to end, sliced many times (a model-parallel cut takes one slice per row)."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = list(spans)
        self.starts = list(itertools.accumulate((s.size for s in self.spans), initial=0))

    def slice(self, start: int, end: int) -> list[Span]:
        """The spans of elements [start, end)."""
        assert start >= end or self.starts[-1] >= end, f"[{start}, {end}) beyond the {self.starts[-1]} elements"
        out: list[Span] = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            first = self.starts[i]
            stop = min(end, self.starts[i + 1])
            if stop > start:
                out += _cut(self.spans[i], start - first, stop - first)
                start = stop
            i += 1
        return out

    def slice_rows(self, start: int, length: int, count: int, stride: int) -> list[Span]:
        """`count` rows of `length` elements, `stride` apart from element `start`, end to end: rows that
        lie in one span become one repeating span, a row across two spans two plain ones."""
        out: list[Span] = []
        row = 0
        while row < count:
            first = start + row * stride
            i = bisect.bisect_right(self.starts, first) - 1
            span, top = self.spans[i], self.starts[i + 1]
            if span.count == 1 and first + length <= top:
                rows = count - row if stride == 0 else min(count - row, (top - first - length) // stride + 1)
                out.append(Span(span.input, span.path, span.start + first - self.starts[i], length, rows,
                                stride if rows > 1 else 0))
                row += rows
            else:
                out += self.slice(first, first + length)
                row += 1
        return out


def _cut(span: Span, a: int, b: int) -> list[Span]:
    """Elements [a, b) of one span (of its output side), as spans."""
    if span.count == 1:
        return [Span(span.input, span.path, span.start + a, b - a)]
    length = span.length
    (r0, c0), (r1, c1) = divmod(a, length), divmod(b, length)
    if r0 == r1:
        return [Span(span.input, span.path, span.start + r0 * span.stride + c0, c1 - c0)]
    out = []
    if c0:
        out.append(Span(span.input, span.path, span.start + r0 * span.stride + c0, length - c0))
        r0 += 1
    if r1 > r0:
        rows = r1 - r0
        out.append(Span(span.input, span.path, span.start + r0 * span.stride, length, rows,
                        span.stride if rows > 1 else 0))
    if c1:
        out.append(Span(span.input, span.path, span.start + r1 * span.stride, c1))
    return out


def join_spans(spans: Sequence[Span]) -> tuple[Span, ...]:
    """The same elements with neighbours that continue each other in one input tensor merged."""
    out: list[Span] = []
    for span in spans:
        last = out[-1] if out else None
        if (last is not None and last.count == span.count == 1
                and (last.input, last.path, last.start + last.length) == (span.input, span.path, span.start)):
            out[-1] = last._replace(length=last.length + span.length)
        elif span.length and span.count:
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
