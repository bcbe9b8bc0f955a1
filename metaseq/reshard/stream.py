"""Write an output shard straight into its file instead of building it in memory first.

    size = stream_output_shard(source, options, rank, fetch, path)  # None: not streamable

`torch.serialization.skip_data` saves the output's structure with every tensor record
reserved but empty (a sparse file). The temp file is then mmap-loaded to find where
each tensor's bytes go (`metaseq.reshard.locate`), and they are written there with
`os.pwrite` straight from the mmap-loaded inputs, one input at a time. Each byte is
copied once, page cache to page cache, as `cp` does (its writeback to disk starts at
once, see `metaseq.torchzip.start_writeback`), and no output tensor is ever allocated: the process
keeps its own ~150 MiB (plus a 64 MiB buffer when casting the dtype) whatever the
output's size. The files carry no zip CRC32s (torch never reads them). When the
structure cannot be located (e.g. tensors inside objects other than dicts, lists and
tuples) nothing is left behind and the caller builds the shard in memory.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from metaseq.file_io import atomic_output, load_checkpoint, save_to_file
from metaseq.reshard.build import ReshardOptions, ReshardSource, assemble_output_shard, plan_targets
from metaseq.reshard.locate import LocatedFile, TensorLocation, locate_tensors
from metaseq.reshard.ranges import Fetch, Target, resolve_path
from metaseq.torchzip import CHUNK_BYTES, gaps, pwrite_all

__all__ = ["CHUNK_BYTES", "stream_output_shard", "zip_crc32"]

Report = Callable[[int], None]


class _NotStreamable(Exception):
    """The saved structure does not line up with the planned tensors; build in memory instead."""


@contextlib.contextmanager
def zip_crc32(enabled: bool) -> Iterator[None]:
    """torch.save computes zip CRC32s at ~0.3 GB/s, and torch.load never reads them."""
    if not hasattr(torch.serialization, "set_crc32_options"):  # older torch: always computed
        yield
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(enabled)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def stream_output_shard(
    source: ReshardSource,
    options: ReshardOptions,
    rank: int,
    fetch: Fetch,
    path: str,
    *,
    trust: bool = False,
    report: Report | None = None,
) -> int | None:
    """Write output shard `rank` to `path` atomically; returns its size, or None (nothing written).

    Same file content as `torch.save(build_output_shard(...))` except the CRC32 fields.
    `report(nbytes)` is called as tensor bytes are written.
    """
    targets = plan_targets(source, options, rank)
    placeholders = {t.path: torch.empty(t.shape, dtype=t.dtype) for t in targets}  # never touched: no memory
    shard = assemble_output_shard(source, options, rank, fetch(0), placeholders)
    try:
        with atomic_output(path) as (f, tmp):
            with torch.serialization.skip_data(), zip_crc32(False):
                save_to_file(shard, f)
            f.flush()
            located = locate_tensors(load_checkpoint(tmp, mmap=True, trust=trust), tmp)
            if located is None:
                raise _NotStreamable(path)
            _fill(f.fileno(), located, targets, shard, fetch, report)
    except _NotStreamable:
        return None
    return os.path.getsize(path)


def _fill(
    fd: int, located: LocatedFile, targets: Sequence[Target], shard: Mapping[str, Any], fetch: Fetch,
    report: Report | None,
) -> None:
    """Every tensor record of the file: targets from the inputs (input by input), the rest from `shard`."""
    places = located.tensors
    by_rank: dict[int, list[tuple[int, Target, Any]]] = defaultdict(list)
    done: set[int] = set()  # record offsets written; tied parameters share one
    for t in targets:
        loc = places.get(t.path)
        if loc is None or loc.shape != tuple(t.shape) or loc.dtype != t.dtype:
            raise _NotStreamable(t.path)
        _zero_uncovered(fd, loc.offset, t)
        for piece in t.pieces:
            by_rank[piece.rank].append((loc.offset + piece.dst_start * t.dtype.itemsize, t, piece))
        done.add(loc.offset)
    cast_buffer: dict[torch.dtype, torch.Tensor] = {}
    for rank in sorted(by_rank):
        inputs = fetch(rank)
        for offset, t, piece in by_rank[rank]:
            src = resolve_path(inputs, piece.path).reshape(-1)[piece.src_start : piece.src_start + piece.length]
            _write_tensor(fd, src, offset, t.dtype, cast_buffer, report)
        del inputs
    for key, loc in places.items():  # carried tensors (e.g. in extra_state) and scalars such as `step`
        if loc.offset not in done:
            _write_carried(fd, resolve_path(shard, key), loc.offset, loc, report)
            done.add(loc.offset)


def _zero_uncovered(fd: int, offset: int, target: Target) -> None:
    """Padding: the reserved bytes read as zeros already (a hole); written anyway, it is small."""
    size = target.dtype.itemsize
    for start, length in gaps(((p.dst_start, p.length) for p in target.pieces), target.shape.numel()):
        pwrite_all(fd, bytes(length * size), offset + start * size)


def _write_carried(fd: int, value: Any, offset: int, loc: TensorLocation, report: Report | None) -> None:
    whole = torch.is_tensor(value) and value.storage_offset() == 0 and value.untyped_storage().nbytes() == value.nbytes
    if not (whole and value.is_contiguous() and value.dtype == loc.dtype and tuple(value.shape) == loc.shape):
        raise _NotStreamable(offset)  # a view: torch.save writes its whole storage, which we do not have here
    _write_tensor(fd, value, offset, value.dtype, {}, report)


def _write_tensor(
    fd: int, src: torch.Tensor, offset: int, dtype: torch.dtype, cast_buffer: dict, report: Report | None
) -> None:
    """`src` (contiguous) as `dtype` at byte `offset`; a cast goes through a reused buffer, chunk by chunk."""
    flat = src.reshape(-1)
    if flat.dtype == dtype:
        pwrite_all(fd, memoryview(flat.view(torch.uint8).numpy()), offset, report)
        return
    step = CHUNK_BYTES // dtype.itemsize
    buffer = cast_buffer.setdefault(dtype, torch.empty(step, dtype=dtype))
    for start in range(0, flat.numel(), step):
        chunk = buffer[: min(step, flat.numel() - start)]
        chunk.copy_(flat[start : start + chunk.numel()])
        pwrite_all(fd, memoryview(chunk.view(torch.uint8).numpy()), offset + start * dtype.itemsize, report)
