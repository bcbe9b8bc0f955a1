"""Where each tensor of a torch zip checkpoint lies in its file, so writing needs no second unpickling.

Planning unpickles every input once (names, shapes, metadata); unpickling is the
per-file cost that dominates many small shards (weights_only is pure Python).
`locate_tensors` notes each tensor's byte offset while the planner holds the
mmap-loaded file, and `map_located` later rebuilds the tensors straight from a
mapping of the file. Anything unusual (legacy format, big-endian data, views that
do not line up with the zip records) gives None, and the caller loads the file.
"""
from __future__ import annotations

import os
import re
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from metaseq.reshard.schema import ReshardError

__all__ = ["LocatedFile", "TensorLocation", "locate_tensors", "map_located"]

_DATA_RECORD_RE = re.compile(r"(?:[^/]*/)?data/\d+")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


@dataclass(frozen=True)
class TensorLocation:
    offset: int  # byte offset of the tensor's first element in the file
    dtype: torch.dtype
    shape: tuple[int, ...]  # contiguous


@dataclass(frozen=True)
class LocatedFile:
    path: str
    size: int  # with mtime_ns: the file must not change between planning and writing
    mtime_ns: int
    tensors: Mapping[tuple[Any, ...], TensorLocation]  # keys from the checkpoint dict down to the tensor


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, torch.Size})


def _tensors(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    if type(obj) in _LEAVES:  # most of a checkpoint's objects (names, shapes): skip the slower checks
        return
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, (*path, key))
    elif type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, i))


def _record_offsets(path: str) -> list[int] | None:
    """File offsets of the tensor records' data, or None if they are not plain little-endian stored records.

    Records are read raw (no CRC32 check): files written without CRC32s store 0 there.
    """
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            offsets, byteorder = [], b"little"
            for info in archive.infolist():
                name = info.filename.split("/", 1)[-1]
                if not (_DATA_RECORD_RE.fullmatch(name) or name == "byteorder"):
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    return None
                f.seek(info.header_offset)
                signature, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                if signature != b"PK\x03\x04":
                    return None
                start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                if name == "byteorder":
                    f.seek(start)
                    byteorder = f.read(info.file_size)
                else:
                    offsets.append(start)
    except (OSError, zipfile.BadZipFile, struct.error, ValueError):
        return None
    return sorted(offsets) if byteorder == b"little" else None


def locate_tensors(shard: Mapping[str, Any], path: str) -> LocatedFile | None:
    """Byte offsets of every tensor of `shard`, the mmap-loaded (`torch.load(mmap=True)`) content of `path`.

    With mmap, the file is one mapping and each storage starts at its zip record's data,
    so the storages' addresses minus the records' offsets must all be one base address.
    """
    found = list(_tensors(shard))
    offsets = _record_offsets(path)
    if not found or offsets is None or not all(t.is_contiguous() and t.device.type == "cpu" for _, t in found):
        return None
    pointers = sorted({t.untyped_storage().data_ptr() for _, t in found})
    base = pointers[0] - offsets[0]
    if len(pointers) != len(offsets) or any(p - base != o for p, o in zip(pointers, offsets)):
        return None
    tensors = {
        key: TensorLocation(t.untyped_storage().data_ptr() - base + t.storage_offset() * t.element_size(),
                            t.dtype, tuple(t.shape))
        for key, t in found
    }
    if any(loc.offset % loc.dtype.itemsize for loc in tensors.values()):  # torch aligns records; a damaged file may not
        return None
    stat = os.stat(path)
    return LocatedFile(path, stat.st_size, stat.st_mtime_ns, tensors)


def map_located(located: LocatedFile) -> dict[str, Any]:
    """The located tensors, mapped from the file (copy-on-write, nothing read yet), in nested dicts."""
    stat = os.stat(located.path)
    if (stat.st_size, stat.st_mtime_ns) != (located.size, located.mtime_ns):
        raise ReshardError(f"{located.path} changed while resharding (size or time differ from planning); rerun")
    data = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage.from_file(located.path, False, located.size))
    out: dict[str, Any] = {}
    for key, loc in located.tensors.items():
        nbytes = loc.dtype.itemsize * torch.Size(loc.shape).numel()
        tensor = data[loc.offset : loc.offset + nbytes].view(loc.dtype).view(loc.shape)
        parent = out
        for part in key[:-1]:
            parent = parent.setdefault(part, {})
        parent[key[-1]] = tensor
    return out
