"""torch's zip checkpoint format, read and written without importing torch.

    obj = read_structure(path)        # tensors come back as TensorRef: where their bytes lie
    write_checkpoint(fd, obj)         # TensorRefs written from their source bytes (copy_file_range)

Importing torch takes 1.5 s or more on a small machine, about as long as copying a
2 GB checkpoint. Resharding never computes on tensor values: it copies byte ranges.
So the reshard tool reads each input's pickle with a restricted unpickler (the same
globals `torch.load(weights_only=True)` allows for these files), plans on `TensorRef`s,
and writes each output as torch's own writer would lay it out: a protocol-2 pickle
in `archive/data.pkl`, one stored (uncompressed) zip record per storage, every record's
data aligned to 64 bytes (what `torch.load(mmap=True)` expects), zip64 where sizes need
it. Tensor bytes go file to file in the kernel (`os.copy_file_range`), never through
Python. Anything else (another global, a big-endian file, a dtype cast) raises
`Unsupported`, and the caller uses torch (`metaseq.file_io`). Records are written with
CRC32 0 except the small ones, as `torch.serialization.set_crc32_options(False)` does.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

__all__ = [
    "ALIGNMENT",
    "DType",
    "Size",
    "Storage",
    "TensorRef",
    "Unsupported",
    "copy_file_range_all",
    "gaps",
    "is_tensor_ref",
    "pwrite_all",
    "read_structure",
    "start_writeback",
    "write_checkpoint",
]

ALIGNMENT = 64  # torch aligns every record's data; mmap-loaded tensors need it
CHUNK_BYTES = 64 << 20  # per copy call: progress and writeback granularity
ZIP64_LIMIT = 0xFFFFFFFF  # sizes/offsets at or above this go into zip64 extra fields
_ZIP64_MARK = 0xFFFFFFFF  # what the classic field then says
Report = Callable[[int], None]


class Unsupported(Exception):
    """This file (or output) needs torch itself: the caller falls back to torch.load / torch.save."""


@dataclass(frozen=True)
class DType:
    """A torch dtype by name; `repr` is torch's (`torch.float32`)."""

    name: str
    itemsize: int
    is_floating_point: bool
    storage: str  # torch's legacy storage class, the pickle's type tag

    def __repr__(self) -> str:
        return f"torch.{self.name}"


_DTYPES = [
    DType("float32", 4, True, "FloatStorage"),
    DType("float64", 8, True, "DoubleStorage"),
    DType("float16", 2, True, "HalfStorage"),
    DType("bfloat16", 2, True, "BFloat16Storage"),
    DType("int64", 8, False, "LongStorage"),
    DType("int32", 4, False, "IntStorage"),
    DType("int16", 2, False, "ShortStorage"),
    DType("int8", 1, False, "CharStorage"),
    DType("uint8", 1, False, "ByteStorage"),
    DType("bool", 1, False, "BoolStorage"),
]
_BY_NAME = {d.name: d for d in _DTYPES}
_STRUCT_CODES = {"float32": "f", "float64": "d", "float16": "e", "int64": "q", "int32": "i", "int16": "h",
                 "int8": "b", "uint8": "B", "bool": "?"}


class Size(tuple):
    """torch.Size stand-in: a tuple that pickles as `torch.Size` again."""

    def numel(self) -> int:
        n = 1
        for dim in self:
            n *= dim
        return n

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


@dataclass(eq=False)
class Storage:
    """`nbytes` bytes of one dtype: zeros except `pieces` (src_path, src_offset, dst_offset, nbytes)."""

    dtype: DType
    nbytes: int
    pieces: list[tuple[str, int, int, int]] = field(default_factory=list)

    @classmethod
    def in_file(cls, path: str, offset: int, dtype: DType, nbytes: int) -> Storage:
        return cls(dtype, nbytes, [(path, offset, 0, nbytes)] if nbytes else [])

    def source_offset(self, element: int) -> tuple[str, int]:
        """(file, byte offset) of element `element` of an input storage."""
        path, offset, _, _ = self.pieces[0]
        return path, offset + element * self.dtype.itemsize


@dataclass(eq=False)
class TensorRef:
    """A tensor as torch's pickle describes it: a view (offset, shape, stride) of a storage."""

    storage: Storage
    storage_offset: int
    shape: Size
    stride: tuple[int, ...]
    requires_grad: bool = False

    @property
    def dtype(self) -> DType:
        return self.storage.dtype

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def size(self) -> Size:
        return self.shape

    def is_contiguous(self) -> bool:
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride)):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    def clone(self) -> TensorRef:
        """A compact copy with its own storage (as `torch.Tensor.clone`)."""
        if not self.is_contiguous() or not self.storage.pieces and self.numel():
            raise Unsupported("clone of a non-contiguous tensor")
        nbytes = self.numel() * self.dtype.itemsize
        path, offset = self.storage.source_offset(self.storage_offset) if nbytes else ("", 0)
        return TensorRef(Storage.in_file(path, offset, self.dtype, nbytes), 0, self.shape, _contiguous(self.shape))

    def squeeze(self) -> TensorRef:
        """The same storage without size-1 dimensions (as `torch.Tensor.squeeze`)."""
        kept = [(d, s) for d, s in zip(self.shape, self.stride) if d != 1]
        return TensorRef(self.storage, self.storage_offset, Size(d for d, _ in kept), tuple(s for _, s in kept),
                         self.requires_grad)

    def item(self) -> int | float | bool:
        """The value of a one-element tensor, read from its file (as `torch.Tensor.item`)."""
        if self.numel() != 1 or not self.storage.pieces:
            raise Unsupported("item() of a tensor that is not one stored element")
        path, offset = self.storage.source_offset(self.storage_offset)
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(self.dtype.itemsize)
        if self.dtype.name == "bfloat16":  # the upper half of a float32
            return struct.unpack("<f", b"\0\0" + data)[0]
        return struct.unpack("<" + _STRUCT_CODES[self.dtype.name], data)[0]

    @classmethod
    def empty(cls, shape: Sequence[int], dtype: DType) -> TensorRef:
        """A new compact tensor of zeros; add `storage.pieces` to fill it."""
        shape = Size(shape)
        return cls(Storage(dtype, shape.numel() * dtype.itemsize), 0, shape, _contiguous(shape))


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def is_tensor_ref(value: Any) -> bool:
    return type(value) is TensorRef


def dtype_by_name(name: str) -> DType:
    return _BY_NAME[name]


# ---------------------------------------------------------------------------------------------
# Reading


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra field length


def _rebuild_tensor(storage: Storage, storage_offset: int, size: tuple, stride: tuple, requires_grad: bool,
                    backward_hooks: Any, metadata: Any = None) -> TensorRef:
    if backward_hooks or metadata:
        raise Unsupported("tensor with hooks or metadata")
    if storage_offset < 0 or any(d < 0 for d in size) or any(s < 0 for s in stride) or len(size) != len(stride):
        raise Unsupported("tensor with a negative offset, size or stride")
    ref = TensorRef(storage, storage_offset, Size(size), tuple(stride), bool(requires_grad))
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride)) if ref.numel() else -1
    if last >= storage.nbytes // storage.dtype.itemsize:
        raise Unsupported("tensor beyond its storage")
    return ref


class _StorageTag:
    def __init__(self, dtype: DType) -> None:
        self.dtype = dtype


# The only globals a pickle may name. Each lookup returns a fresh object: BUILD can set
# attributes on what a pickle names, and it must not reach anything shared with other files.
_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("collections", "OrderedDict"): lambda: collections.OrderedDict,  # a class: BUILD cannot change it
    ("torch._utils", "_rebuild_tensor_v2"): lambda: lambda *args: _rebuild_tensor(*args),
    ("torch", "Size"): lambda: Size,
}
_GLOBALS.update({("torch", d.storage): (lambda d=d: _StorageTag(d)) for d in _DTYPES})
_GLOBALS.update({("torch", d.name): (lambda d=d: DType(d.name, d.itemsize, d.is_floating_point, d.storage))
                 for d in _DTYPES})


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, records: dict[str, tuple[int, int]], path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.records, self.path = records, path
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            make = _GLOBALS[(module, name)]
        except KeyError:
            raise Unsupported(f"global {module}.{name}") from None
        return make()

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageTag)):
            raise Unsupported(f"persistent id {pid!r:.60}")
        _, tag, key, _location, numel = pid  # location (e.g. cuda:0) dropped: cpu, as map_location="cpu" does
        if key not in self.storages:
            offset, size = self.records.get(f"data/{key}", (-1, -1))
            if size != numel * tag.dtype.itemsize:
                raise Unsupported(f"storage {key}: record of {size} bytes for {numel} elements")
            self.storages[key] = Storage.in_file(self.path, offset, tag.dtype, size)
        return self.storages[key]


def _zip_records(path: str) -> tuple[dict[str, tuple[int, int]], bytes]:
    """{record name without the archive folder: (data offset, size)} and the pickle's bytes."""
    records: dict[str, tuple[int, int]] = {}
    pkl = b""
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
            file_size = os.fstat(f.fileno()).st_size
            infos = archive.infolist()
            if not infos or "/" not in infos[0].filename:
                raise Unsupported("not a torch zip checkpoint")
            prefix = infos[0].filename.split("/", 1)[0] + "/"
            for info in infos:
                if not info.filename.startswith(prefix) or info.compress_type != zipfile.ZIP_STORED:
                    raise Unsupported(f"record {info.filename}")
                f.seek(info.header_offset)
                signature, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                if signature != b"PK\x03\x04":
                    raise Unsupported("bad local header")
                start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                if start + info.file_size > file_size:
                    raise Unsupported(f"record {info.filename} runs past the end of the file")
                name = info.filename[len(prefix):]
                records[name] = (start, info.file_size)
                if name in ("data.pkl", "byteorder"):
                    f.seek(start)
                    data = f.read(info.file_size)
                    if len(data) != info.file_size or (info.CRC and zlib.crc32(data) != info.CRC):
                        raise Unsupported(f"record {name} damaged")
                    if name == "byteorder" and data != b"little":
                        raise Unsupported("big-endian file")
                    pkl = data if name == "data.pkl" else pkl
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 -- damaged zip (zipfile raises many kinds): torch.load reports it
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    if "data.pkl" not in records:
        raise Unsupported("no data.pkl")
    return records, pkl


def read_structure(path: str) -> Any:
    """The checkpoint's object, with `TensorRef`s for tensors; reads only the pickle and zip directory.

    Raises Unsupported for anything `write_checkpoint` could not write back the way torch would.
    """
    records, pkl = _zip_records(path)
    try:
        obj = _Unpickler(pkl, records, path).load()
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 -- damaged pickle: torch.load gives the proper error
        raise Unsupported(f"pickle: {e}") from None
    _check_writable(obj)
    return obj


_LEAVES = (str, int, float, bool, type(None), DType, Size, TensorRef)


def _check_writable(obj: Any, depth: int = 0) -> None:
    if depth > 200:
        raise Unsupported("nested too deep")
    kind = type(obj)
    if kind in _LEAVES:
        return
    if kind in (dict, collections.OrderedDict):
        if kind is collections.OrderedDict and vars(obj):
            _check_writable(vars(obj), depth + 1)
        for key, value in obj.items():
            _check_writable(key, depth + 1)
            _check_writable(value, depth + 1)
    elif kind in (list, tuple):
        for value in obj:
            _check_writable(value, depth + 1)
    else:
        raise Unsupported(f"object of type {kind.__name__}")


# ---------------------------------------------------------------------------------------------
# Writing: the pickle


class _Pickler:
    """Protocol-2 pickle of dicts, lists, tuples, scalars, Size, DType and TensorRef, as torch.save writes it.

    Tensors refer to storages by persistent id ('storage', torch.<X>Storage, key, 'cpu', numel);
    keys "0", "1", ... in order of first use. Dicts, lists and tensors are memoized, so shared
    objects (tied weights) stay shared on load.
    """

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # memoized objects stay alive: their id() stays unique
        self.storages: dict[int, tuple[str, Storage]] = {}

    def dump(self, obj: Any) -> bytes:
        self._save(obj)
        self.out += b"."
        return bytes(self.out)

    def _memoize(self, obj: Any) -> None:
        index = len(self.memo)
        self.memo[id(obj)] = index
        self.keep.append(obj)
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def _get(self, obj: Any) -> bool:
        index = self.memo.get(id(obj))
        if index is None:
            return False
        self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
        return True

    def _global(self, module: str, name: str) -> None:
        self.out += f"c{module}\n{name}\n".encode()

    def _save(self, obj: Any) -> None:
        kind = type(obj)
        if obj is None:
            self.out += b"N"
        elif kind is bool:
            self.out += b"\x88" if obj else b"\x89"
        elif kind is int:
            self._int(obj)
        elif kind is float:
            self.out += b"G" + struct.pack(">d", obj)
        elif kind is str:
            data = obj.encode("utf-8", "surrogatepass")
            self.out += b"X" + struct.pack("<I", len(data)) + data
        elif kind is tuple:
            self._tuple(obj)
        elif self._get(obj):
            return
        elif kind in (dict, collections.OrderedDict):
            self._dict(obj)
        elif kind is list:
            self.out += b"]"
            self._memoize(obj)
            self._items(obj, b"e")
        elif kind is Size:
            self._global("torch", "Size")
            self._tuple((tuple(obj),))
            self.out += b"R"
        elif kind is DType:
            self._global("torch", obj.name)
        elif kind is TensorRef:
            self._tensor(obj)
        else:
            raise Unsupported(f"cannot write a {kind.__name__}")

    def _int(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(1 << 31) <= value < (1 << 31):
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data

    def _tuple(self, items: tuple) -> None:
        if not items:
            self.out += b")"
            return
        if len(items) <= 3:
            for item in items:
                self._save(item)
            self.out += b"\x85\x86\x87"[len(items) - 1 : len(items)]
            return
        self.out += b"("
        for item in items:
            self._save(item)
        self.out += b"t"

    def _items(self, items: Sequence[Any], opcode: bytes) -> None:
        if items:
            self.out += b"("
            for item in items:
                self._save(item)
            self.out += opcode

    def _dict(self, obj: dict) -> None:
        ordered = type(obj) is collections.OrderedDict
        if ordered:
            self._global("collections", "OrderedDict")
            self.out += b")R"
        else:
            self.out += b"}"
        self._memoize(obj)
        if obj:
            self.out += b"("
            for key, value in obj.items():
                self._save(key)
                self._save(value)
            self.out += b"u"
        if ordered and vars(obj):  # e.g. a state dict's `_metadata`
            self._save(dict(vars(obj)))
            self.out += b"b"

    def _tensor(self, ref: TensorRef) -> None:
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("
        key, storage = self.storages.setdefault(id(ref.storage), (str(len(self.storages)), ref.storage))
        numel = storage.nbytes // storage.dtype.itemsize
        self.out += b"("
        self._save("storage")
        self._global("torch", storage.dtype.storage)
        self._save(key)
        self._save("cpu")
        self._save(numel)
        self.out += b"tQ"
        self._save(ref.storage_offset)
        self._tuple(tuple(ref.shape))
        self._tuple(tuple(ref.stride))
        self._save(ref.requires_grad)
        self._global("collections", "OrderedDict")
        self.out += b")Rt"
        self.out += b"R"
        self._memoize(ref)


# ---------------------------------------------------------------------------------------------
# Writing: the zip file


@dataclass
class _Record:
    name: str
    size: int
    data: bytes | None = None  # small records; storages are copied in
    storage: Storage | None = None
    crc: int = 0
    header_offset: int = 0
    data_offset: int = 0
    local_header: bytes = b""


def _local_header(record: _Record, name: bytes) -> bytes:
    """Local file header + extra fields, padded so the data starts at a multiple of ALIGNMENT."""
    zip64 = record.size >= ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 1, 16, record.size, record.size) if zip64 else b""
    sizes = (_ZIP64_MARK, _ZIP64_MARK) if zip64 else (record.size, record.size)
    fixed = 30 + len(name) + len(extra) + 4  # + the padding field's own header
    pad = -(record.header_offset + fixed) % ALIGNMENT
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": torch's padding field
    head = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45 if zip64 else 20, 0, 0, 0, 33, record.crc, *sizes,
                       len(name), len(extra))
    return head + name + extra


def _central_entry(record: _Record, name: bytes) -> bytes:
    values = [record.size, record.size, record.header_offset]
    big = [v >= ZIP64_LIMIT for v in values]
    extra = b"".join(struct.pack("<Q", v) for v, b in zip(values, big) if b)
    if extra:
        extra = struct.pack("<HH", 1, len(extra)) + extra
    shown = [_ZIP64_MARK if b else v for v, b in zip(values, big)]
    version = 45 if extra else 20
    return struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", version, version, 0, 0, 0, 33, record.crc,
                       shown[0], shown[1], len(name), len(extra), 0, 0, 0, 0, shown[2]) + name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """zip64 end record and locator (always, as torch writes them), then the classic end record."""
    zip64_end = cd_offset + cd_size
    out = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, zip64_end, 1)
    small = [min(count, 0xFFFF), min(cd_size, _ZIP64_MARK), min(cd_offset, _ZIP64_MARK)]
    return out + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, small[0], small[0], small[1], small[2], 0)


def _records(obj: Any, archive: str) -> list[_Record]:
    pickler = _Pickler()
    pkl = pickler.dump(obj)
    small = lambda name, data: _Record(f"{archive}/{name}", len(data), data, crc=zlib.crc32(data))  # noqa: E731
    records = [small("data.pkl", pkl), small(".format_version", b"1"),
               small(".storage_alignment", str(ALIGNMENT).encode()), small("byteorder", b"little")]
    for key, storage in pickler.storages.values():
        records.append(_Record(f"{archive}/data/{key}", storage.nbytes, storage=storage))
    serialization_id = str(int.from_bytes(os.urandom(16), "little")).zfill(40)[:40].encode()
    records += [small("version", b"3\n"), small(".data/serialization_id", serialization_id)]
    return records


def write_checkpoint(fd: int, obj: Any, *, archive: str = "archive", report: Report | None = None) -> int:
    """Write `obj` as a torch checkpoint to the empty file `fd`; returns the file size.

    Every storage is filled from its pieces with `copy_file_range`; bytes no piece covers are zeros.
    The copies go input file by input file, in file order: one input is open at a time (a
    checkpoint may have a thousand shards) and each is read front to back. `report(nbytes)`
    is called as storage bytes are copied.
    """
    records = _records(obj, archive)
    offset = 0
    for record in records:
        record.header_offset = offset
        record.local_header = _local_header(record, record.name.encode())
        record.data_offset = offset + len(record.local_header)
        offset = record.data_offset + record.size
    cd = b"".join(_central_entry(r, r.name.encode()) for r in records)
    copies: dict[str, list[tuple[int, int, int]]] = {}  # source file: (src offset, dst offset, nbytes)
    for record in records:
        pwrite_all(fd, record.local_header, record.header_offset)
        if record.data is not None:
            pwrite_all(fd, record.data, record.data_offset)
            continue
        spans = ((dst_offset, nbytes) for _, _, dst_offset, nbytes in record.storage.pieces)
        for start, nbytes in gaps(spans, record.storage.nbytes):  # padding
            _write_zeros(fd, record.data_offset + start, nbytes)
        for src_path, src_offset, dst_offset, nbytes in record.storage.pieces:
            copies.setdefault(src_path, []).append((src_offset, record.data_offset + dst_offset, nbytes))
    for src_path, ranges in copies.items():
        src = os.open(src_path, os.O_RDONLY)
        try:
            for src_offset, dst_offset, nbytes in sorted(ranges):
                copy_file_range_all(src, fd, nbytes, src_offset, dst_offset, report)
        finally:
            os.close(src)
    tail = cd + _end_records(len(records), offset, len(cd))
    pwrite_all(fd, tail, offset)
    return offset + len(tail)


def gaps(spans: Iterable[tuple[int, int]], total: int) -> Iterator[tuple[int, int]]:
    """(start, length) of the parts of [0, total) that no (start, length) span covers."""
    pos = 0
    for start, length in sorted(spans):
        if start > pos:
            yield pos, start - pos
        pos = max(pos, start + length)
    if pos < total:
        yield pos, total - pos


def _write_zeros(fd: int, offset: int, nbytes: int) -> None:
    zeros = bytes(min(nbytes, CHUNK_BYTES))
    while nbytes:
        n = min(nbytes, len(zeros))
        pwrite_all(fd, memoryview(zeros)[:n], offset)
        offset, nbytes = offset + n, nbytes - n


def pwrite_all(fd: int, data: bytes | memoryview, offset: int, report: Report | None = None) -> None:
    """Write all of `data` at `offset`, CHUNK_BYTES per call, starting each chunk's writeback."""
    view = memoryview(data).cast("B")
    pos = 0
    while pos < len(view):
        n = os.pwrite(fd, view[pos : pos + CHUNK_BYTES], offset + pos)
        start_writeback(fd, offset + pos, n)
        pos += n
        if report is not None:
            report(n)


_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def copy_file_range_all(src: int, dst: int, nbytes: int, src_offset: int, dst_offset: int,
                        report: Report | None = None) -> None:
    """Copy bytes between files in the kernel (page cache to page cache), or by pread/pwrite where unsupported."""
    use_kernel = hasattr(os, "copy_file_range")
    while nbytes:
        step = min(nbytes, CHUNK_BYTES)
        n = 0
        if use_kernel:
            try:
                n = os.copy_file_range(src, dst, step, src_offset, dst_offset)
            except OSError as e:
                if e.errno not in _NO_COPY_FILE_RANGE:
                    raise
                use_kernel = False
            else:
                start_writeback(dst, dst_offset, n)
        if not use_kernel:
            data = os.pread(src, step, src_offset)
            pwrite_all(dst, data, dst_offset)
            n = len(data)
        if n == 0:
            raise OSError(errno.EIO, f"input ended {nbytes} bytes early (file changed while resharding?)")
        if report is not None:
            report(n)
        nbytes, src_offset, dst_offset = nbytes - n, src_offset + n, dst_offset + n


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing these bytes to disk now, so the final fsync finds little left.

    On Linux, POSIX_FADV_DONTNEED on dirty pages starts their writeback without waiting
    (and drops only pages already clean); elsewhere this does nothing.
    """
    if length >= CHUNK_BYTES // 4 and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
