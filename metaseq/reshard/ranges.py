"""Element ranges of flat parameters: how FSDP splits them and where each piece lives.

Once its padding is stripped, a flat parameter of `numel` elements is one 1-D range
[0, numel). Its sources are `Segment`s laid end to end (one per input rank, or one
per original parameter for a consolidated file). An output tensor is a `Target`: a
shape plus the `Piece`s to copy into it, each read from one input file. Nothing here
does I/O; `materialize_targets` asks a caller-supplied `fetch(rank)` for input dicts.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

from metaseq.torchzip import gaps

if TYPE_CHECKING:
    import torch

__all__ = [
    "Piece",
    "Segment",
    "Target",
    "materialize_targets",
    "plan_range",
    "resolve_path",
    "shard_range",
]

Fetch = Callable[[int], Mapping[str, Any]]
Allocate = Callable[..., "torch.Tensor"]  # (shape, *, dtype) -> tensor, like torch.empty


class Segment(NamedTuple):
    """`length` elements at the start of the flattened tensor at `path` in input `rank`."""

    rank: int
    path: tuple[Any, ...]  # keys from the input dict down to the tensor
    length: int


class Piece(NamedTuple):
    """Copy `length` elements from input `rank`'s tensor at `path` (flattened)."""

    rank: int
    path: tuple[Any, ...]
    src_start: int
    dst_start: int
    length: int


class Target(NamedTuple):
    """One output tensor: zeros of `shape`/`dtype`, filled by `pieces` (the rest is padding)."""

    path: tuple[Any, ...]  # keys in the output dict
    shape: torch.Size
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


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


def plan_range(segments: Sequence[Segment], start: int, end: int) -> tuple[Piece, ...]:
    """Pieces that copy global elements [start, end) of the segments laid end to end.

    `dst_start` is relative to `start`, so the pieces fill a tensor of end - start elements.
    """
    pieces = []
    seg_start = 0
    for seg in segments:
        seg_end = seg_start + seg.length
        lo, hi = max(start, seg_start), min(end, seg_end)
        if lo < hi:
            pieces.append(Piece(seg.rank, seg.path, lo - seg_start, lo - start, hi - lo))
        seg_start = seg_end
    assert start >= end or seg_start >= end, f"range [{start}, {end}) beyond the {seg_start} source elements"
    return tuple(pieces)


def resolve_path(obj: Any, path: Sequence[Any]) -> Any:
    """obj[path[0]][path[1]]..."""
    for key in path:
        obj = obj[key]
    return obj


def materialize_targets(
    targets: Sequence[Target],
    fetch: Fetch,
    *,
    allocate: Allocate | None = None,
    on_copied: Callable[[int], None] | None = None,
) -> dict[tuple[Any, ...], torch.Tensor]:
    """Allocate every target and copy its pieces in, visiting each input rank once.

    Inputs are fetched in rank order and dropped before the next one, so with
    mmap-loaded files only one input's touched pages are alive at a time. Elements
    no piece covers (padding) are zeroed, so `allocate(shape, dtype=...)` may
    return uninitialized or reused memory. `on_copied(nbytes)` is called after each input.
    """
    if allocate is None:
        import torch

        allocate = torch.empty
    out = {t.path: allocate(t.shape, dtype=t.dtype) for t in targets}
    by_rank: dict[int, list[tuple[torch.Tensor, Piece]]] = defaultdict(list)
    for t in targets:
        flat_dst = out[t.path].view(-1)
        _zero_uncovered(flat_dst, t.pieces)
        for piece in t.pieces:
            by_rank[piece.rank].append((flat_dst, piece))
    for rank in sorted(by_rank):
        shard = fetch(rank)
        for flat_dst, piece in by_rank[rank]:
            src = resolve_path(shard, piece.path).reshape(-1)
            dst = flat_dst[piece.dst_start : piece.dst_start + piece.length]
            dst.copy_(src[piece.src_start : piece.src_start + piece.length])
        del shard, src
        if on_copied is not None:
            on_copied(sum(p.length * f.element_size() for f, p in by_rank[rank]))
    return out


def _zero_uncovered(flat: torch.Tensor, pieces: Sequence[Piece]) -> None:
    """Zero the elements of `flat` outside every piece's [dst_start, dst_start + length)."""
    for start, length in gaps(((p.dst_start, p.length) for p in pieces), flat.numel()):
        flat[start : start + length].zero_()
