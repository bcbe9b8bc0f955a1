"""Element ranges: how FSDP splits a flat parameter, and the runs of input elements that fill an output.

A tensor's elements are counted in row-major order. Where they come from is a list of
`Span`s laid end to end, each a stretch of one input tensor; the part of it an output
needs is a list of `Run`s, each copied as one block of bytes. A span or run may repeat:
`count` blocks of `length` elements, `stride` elements apart in the input and end to end
in the output (the rows of a weight that model parallelism cuts on its second dim). A
`Tile` is such spans side by side: row r of the tile is row r of each (the rows of a
weight whose model parts are merged on its second dim). Nothing here does I/O.
"""
from __future__ import annotations

import bisect
import functools
import itertools
from typing import Any, NamedTuple, Sequence

from metaseq.torchzip import DType, Size

__all__ = ["OutTensor", "Run", "Span", "Spans", "Tile", "join_spans", "plan_range", "shard_range"]


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


class Tile(NamedTuple):
    """Repeating spans of equal `count`, side by side: output row r is row r of each, in order."""

    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.spans)

    @property
    def width(self) -> int:
        return sum(s.length for s in self.spans)


class Run(NamedTuple):
    """Copy `length` elements of input `input`'s tensor at `path`, from its element `start`,
    to element `offset` of the output tensor (`count` times: input `stride` apart, output
    `pitch` apart, 0 for end to end)."""

    input: int
    path: tuple[Any, ...]
    start: int
    offset: int
    length: int
    count: int = 1
    stride: int = 0
    pitch: int = 0


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, padded_len) of `rank`'s slice of an unpadded flat parameter, as fairscale's `_get_shard`
    (torch.chunk): every rank holds padded_len = ceil(numel / world_size) elements, rank r keeps
    full[r * padded_len : (r + 1) * padded_len] padded with zeros (trailing ranks: partly or all padding)."""
    assert world_size >= 1 and 0 <= rank < world_size, (world_size, rank)
    padded_len = -(-numel // world_size)
    start = min(rank * padded_len, numel)
    return start, min(start + padded_len, numel), padded_len


def plan_range(spans: Sequence[Span | Tile], start: int, end: int, offset: int = 0) -> tuple[Run, ...]:
    """Runs that copy elements [start, end) of the spans laid end to end, to output elements from `offset` (a
    layout's `Spans` keep their index from one call to the next)."""
    runs = []
    for item in (spans if isinstance(spans, Spans) else Spans(spans)).slice(start, end):
        pieces, pitch = (item.spans, item.width) if isinstance(item, Tile) else ((item,), 0)
        for s, at in zip(pieces, itertools.accumulate((s.length for s in pieces), initial=offset)):
            runs.append(Run(s.input, s.path, s.start, at, s.length, s.count, s.stride, pitch))
        offset += item.size
    return tuple(runs)


def side_by_side(columns: Sequence[Sequence[tuple[int, list[Span]]]]) -> list[Span | Tile]:
    """Rows whose pieces lie in several places, row after row, each row its pieces in order. `columns[k]` holds
    every row's k-th piece as `Spans.slice_rows` groups them; rows where each column repeats become one tile,
    a row that crosses an input's span boundary in some column becomes plain spans."""
    indexes = [Spans(s for _, spans in column for s in spans) for column in columns]
    num_rows = sum(rows for rows, _ in columns[0]) or 1  # (0 rows: nothing to slice)
    widths = [index.starts[-1] // num_rows for index in indexes]
    ends = sorted({end for column in columns for end in itertools.accumulate(rows for rows, _ in column)})
    out: list[Span | Tile] = []
    for first, end in zip([0] + ends, ends):  # rows [first, end) lie in one group of every column
        pieces = [p for index, w in zip(indexes, widths) for p in index.slice(first * w, end * w)]
        out += [Tile(tuple(pieces))] if end - first > 1 and len(pieces) > 1 else pieces
    return out


class Spans(tuple):
    """Spans (and tiles) laid end to end: a flat parameter's or a state's elements. Sliced many times (once per
    output, and row by row by a model-parallel cut), so their start offsets are computed once."""

    @functools.cached_property
    def starts(self) -> list[int]:
        return list(itertools.accumulate((s.size for s in self), initial=0))

    def slice(self, start: int, end: int) -> list[Span | Tile]:
        """The spans (and tiles) of elements [start, end)."""
        assert start >= end or self.starts[-1] >= end, f"[{start}, {end}) beyond the {self.starts[-1]} elements"
        out: list[Span | Tile] = []
        first = bisect.bisect_right(self.starts, start) - 1
        for i in range(first, bisect.bisect_left(self.starts, end, hi=len(self))):
            lo, hi = max(start, self.starts[i]), min(end, self.starts[i + 1])
            if lo < hi:
                out += _cut(self[i], lo - self.starts[i], hi - self.starts[i])
        return out

    def slice_rows(self, start: int, length: int, count: int, stride: int) -> list[tuple[int, list[Span]]]:
        """`count` rows of `length` elements, `stride` apart from element `start`, as (rows, spans)
        groups: rows that lie in one span are one repeating span, a row across spans its pieces."""
        out, row = [], 0
        while row < count:
            first = start + row * stride
            i = bisect.bisect_right(self.starts, first) - 1
            span, top = self[i], self.starts[i + 1]
            if span.count == 1 and first + length <= top:
                rows = count - row if stride == 0 else min(count - row, (top - first - length) // stride + 1)
                out.append((rows, [Span(span.input, span.path, span.start + first - self.starts[i], length, rows,
                                         stride if rows > 1 else 0)]))
                row += rows
            else:
                out.append((1, self.slice(first, first + length)))
                row += 1
        return out


def _cut(item: Span | Tile, a: int, b: int) -> list[Span | Tile]:
    """Elements [a, b) of one span or tile (of its output side)."""
    spans, width = (item.spans, item.width) if isinstance(item, Tile) else ((item,), item.length)
    (r0, c0), (r1, c1) = divmod(a, width), divmod(b, width)
    if r0 == r1:
        return _rows(spans, r0, 1, c0, c1)
    whole = r0 + 1 if c0 else r0  # the first whole row
    head = _rows(spans, r0, 1, c0, width) if c0 else []
    body = _rows(spans, whole, r1 - whole, 0, width) if r1 > whole else []
    return head + body + _rows(spans, r1, 1, 0, c1)


def _rows(spans: Sequence[Span], row: int, count: int, a: int, b: int) -> list[Span | Tile]:
    """Elements [a, b) of `count` rows from `row` of spans side by side: plain spans if one row, else repeating."""
    pieces, pos = [], 0
    for s in spans:
        lo, hi = max(a, pos), min(b, pos + s.length)
        if lo < hi:
            stride = s.stride if count > 1 else 0
            pieces.append(Span(s.input, s.path, s.start + row * s.stride + lo - pos, hi - lo, count, stride))
        pos += s.length
    return [Tile(tuple(pieces))] if count > 1 and len(pieces) > 1 else pieces


def join_spans(spans: Sequence[Span | Tile]) -> Spans:
    """The same elements with neighbours that continue each other in one input tensor merged."""
    out: list[Span | Tile] = []
    for span in spans:
        last = out[-1] if out else None
        if (isinstance(last, Span) and isinstance(span, Span) and last.count == span.count == 1
                and (last.input, last.path, last.start + last.length) == (span.input, span.path, span.start)):
            out[-1] = last._replace(length=last.length + span.length)
        elif span.size:
            out.append(span)
    return Spans(out)


class OutTensor(NamedTuple):
    """One output tensor: `shape` and `dtype`, zeros except what `runs` copy in (the rest is padding)."""

    path: tuple[Any, ...]  # keys in the output's dict
    shape: Size
    dtype: DType
    runs: tuple[Run, ...]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize
