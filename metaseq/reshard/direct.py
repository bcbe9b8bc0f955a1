"""Resharding without torch: plan on the inputs' pickles, copy tensor bytes file to file.

    inputs = read_direct_inputs(paths)                 # None: some input needs torch.load
    source = analyze_shards([i.structure for i in inputs], paths, options)
    size = write_direct_output(source, options, rank, inputs, path)

Each input's pickle is read by `metaseq.torchzip.read_structure` (tensors become
`TensorRef`s: where their bytes lie), the same planning code as with torch decides
what goes where, and `metaseq.torchzip.write_checkpoint` writes each output with
`copy_file_range`. The process never imports torch (1.5 s or more to start), never
maps an input and holds no tensor: memory is the interpreter's plus the pickles.
The result loads with `torch.load` exactly like what the torch path writes, without
zip CRC32s on tensor records. Casting (`--output-dtype`), `--verify` (zip CRC32s)
and inputs with other pickled types take the torch path (`metaseq.reshard.stream`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from metaseq.file_io import atomic_output
from metaseq.reshard.build import ReshardOptions, ReshardSource, assemble_output_shard, plan_targets
from metaseq.reshard.ranges import Target, resolve_path
from metaseq.reshard.schema import ReshardError
from metaseq.torchzip import TensorRef, Unsupported, is_tensor_ref, read_structure, write_checkpoint

__all__ = ["DirectInput", "check_direct_sources", "read_direct_inputs", "write_direct_output"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectInput:
    path: str
    size: int  # with mtime_ns: the file must not change between planning and writing
    mtime_ns: int
    structure: dict[str, Any]  # the checkpoint, tensors as TensorRef


def read_direct_inputs(paths: Sequence[str]) -> list[DirectInput] | None:
    """Every input's structure, or None when one of them needs torch (the caller loads them with torch)."""
    inputs = []
    for path in paths:
        try:
            stat = os.stat(path)
            structure = read_structure(path)
        except (Unsupported, OSError) as e:
            logger.info("%s needs torch.load (%s): reading and writing through torch, which is slower", path, e)
            return None
        if not isinstance(structure, dict):
            return None
        inputs.append(DirectInput(path, stat.st_size, stat.st_mtime_ns, structure))
    return inputs


def check_direct_sources(source: ReshardSource, options: ReshardOptions, inputs: Sequence[DirectInput]) -> None:
    """Raise Unsupported unless every output can be written by copying bytes (no cast, no gather).

    Every output is assembled once around empty tensors, so carried values that need torch
    (e.g. a non-contiguous optimizer scalar to clone) show up now, before anything is written.
    """
    seen = set()
    for rank in range(options.num_output_shards):
        targets = plan_targets(source, options, rank)
        for target in targets:
            for piece in target.pieces:
                if (piece.rank, piece.path) in seen:
                    continue
                seen.add((piece.rank, piece.path))
                src = resolve_path(inputs[piece.rank].structure, piece.path)
                if not is_tensor_ref(src) or src.dtype != target.dtype or not src.is_contiguous():
                    raise Unsupported(f"{inputs[piece.rank].path}: {piece.path} needs a cast or gather")
        empty = {t.path: TensorRef.empty(t.shape, t.dtype) for t in targets}
        assemble_output_shard(source, options, rank, inputs[0].structure, empty)


def write_direct_output(
    source: ReshardSource,
    options: ReshardOptions,
    rank: int,
    inputs: Sequence[DirectInput],
    path: str,
    *,
    report: Callable[[int], None] | None = None,
) -> int:
    """Write output shard `rank` to `path` atomically; returns its size. `report(nbytes)` as bytes are copied."""
    _check_unchanged(inputs)
    structures = [i.structure for i in inputs]
    tensors = {t.path: _target_tensor(t, structures) for t in plan_targets(source, options, rank)}
    shard = assemble_output_shard(source, options, rank, structures[0], tensors)
    try:
        with atomic_output(path) as (f, _):
            return write_checkpoint(f.fileno(), shard, report=report)
    except OSError as e:
        raise ReshardError(f"{path}: cannot write ({e.strerror or e})") from e


def _target_tensor(target: Target, structures: Sequence[Any]) -> TensorRef:
    """A new tensor whose storage is filled from the pieces' byte ranges in the input files."""
    out = TensorRef.empty(target.shape, target.dtype)
    size = target.dtype.itemsize
    for piece in target.pieces:
        src = resolve_path(structures[piece.rank], piece.path)  # a compact TensorRef: check_direct_sources
        src_path, src_offset = src.storage.source_offset(src.storage_offset + piece.src_start)
        out.storage.pieces.append((src_path, src_offset, piece.dst_start * size, piece.length * size))
    return out


def _check_unchanged(inputs: Sequence[DirectInput]) -> None:
    for item in inputs:
        stat = os.stat(item.path)
        if (stat.st_size, stat.st_mtime_ns) != (item.size, item.mtime_ns):
            raise ReshardError(f"{item.path} changed while resharding (size or time differ from planning); rerun")
