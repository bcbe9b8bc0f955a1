"""torch's zip checkpoint format, read and written without importing torch.

    obj, unknown = read_checkpoint(path)   # tensors come back as TensorRef: where their bytes lie
    write_checkpoint(fd, obj)              # storages filled from their sources (copy_file_range)

Resharding never computes on tensor values: it moves byte ranges, and importing torch
alone takes about as long as copying a 2 GB checkpoint. So each input's pickle is read
by a restricted unpickler and each output is written as torch.save writes it: the same
protocol-2 pickle in `archive/data.pkl`, one stored zip record per storage, record data
aligned to 64 bytes (what `torch.load(mmap=True)` expects), zip64 where sizes need it.

The unpickler resolves only the format's own globals (tensor rebuilding, storage types,
`torch.Size`, dtypes, `OrderedDict`). Any other (a `Namespace`, a class of a package this
one lacks) is never imported or called but kept as an `Opaque`, which the writer pickles
back the same way (a loader that has the class gets an equal object). What this reader
cannot take (torch's legacy format, big-endian data) raises `NeedsTorch`: load it with
torch and pass it to `from_torch`.
"""
from __future__ import annotations

import codecs
import collections
import contextlib
import copy
import copyreg
import errno
import functools
import io
import math
import mmap
import os
import pickle
import signal
import struct
import sys
import threading
import zipfile
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Sequence

from metaseq.errors import CheckpointLoadError

__all__ = ["ALIGNMENT", "Copy", "DType", "NeedsTorch", "Opaque", "Size", "Storage", "TensorRef", "check_record",
           "copy_file_range_all", "dtype_by_name", "from_torch", "import_torch", "pwrite_all", "pickle_bytes",
           "read_at", "read_checkpoint", "signals_held", "to_torch", "write_checkpoint", "zip_records"]

ALIGNMENT = 64  # torch aligns every record's data; mmap-loaded tensors need it
CHUNK_BYTES = 64 << 20  # per copy call: progress and writeback granularity
CAST_BYTES = 8 << 20  # elements read, cast and written at a time (a few such buffers are alive)
WINDOW_BYTES = 16 << 20  # one read covering many small copies of one source
MANY_COPIES = 64  # a storage of more copies than this (and at most WINDOW_BYTES) is gathered in memory
SMALL_BYTES = 64  # storages this small are read with the pickle (values such as `step`)
ZIP64_LIMIT = 0xFFFFFFFF  # sizes/offsets at or above this go into zip64 extra fields
_ZIP64_MARK = 0xFFFFFFFF  # what the classic field then says
Report = Callable[[int], None]


class NeedsTorch(Exception):
    """The file is not one this module reads (legacy format, big-endian): load it with torch."""


@dataclass(frozen=True)
class DType:
    """A torch dtype by name; `repr` is torch's (`torch.float32`)."""

    name: str
    itemsize: int
    is_floating_point: bool
    storage: str  # torch's legacy storage class, the pickle's type tag
    code: str  # struct format of one element ("" for bfloat16: the upper half of a float32)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def unpack(self, data: bytes) -> list[int | float | bool]:
        """The elements `data` holds, as numbers."""
        if not self.code:  # bfloat16: the upper half of a float32
            data = b"".join(b"\0\0" + data[i : i + 2] for i in range(0, len(data), 2))
        return [v for (v,) in struct.iter_unpack("<" + (self.code or "f"), data)]


_DTYPES = [
    DType("float32", 4, True, "FloatStorage", "f"),
    DType("float64", 8, True, "DoubleStorage", "d"),
    DType("float16", 2, True, "HalfStorage", "e"),
    DType("bfloat16", 2, True, "BFloat16Storage", ""),
    DType("int64", 8, False, "LongStorage", "q"),
    DType("int32", 4, False, "IntStorage", "i"),
    DType("int16", 2, False, "ShortStorage", "h"),
    DType("int8", 1, False, "CharStorage", "b"),
    DType("uint8", 1, False, "ByteStorage", "B"),
    DType("bool", 1, False, "BoolStorage", "?"),
]
_BY_NAME = {d.name: d for d in _DTYPES}


def dtype_by_name(name: str) -> DType:
    """`"float16"` (or `"torch.float16"`) -> its DType."""
    return _BY_NAME[name.removeprefix("torch.")]


class Size(tuple):
    """torch.Size stand-in: a tuple that pickles as `torch.Size` again."""

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class Copy(NamedTuple):
    """`numel` elements of `src_dtype` at byte `src_offset` of `source`, into byte `dst_offset` of a storage.

    `source` is a file path or the bytes themselves; elements are cast to the storage's
    dtype where it differs (with torch, chunk by chunk). With `count` > 1, `count` such
    blocks `src_stride` bytes apart in the source go `dst_stride` bytes apart (0: end to
    end) into the storage.
    """

    source: str | bytes | memoryview
    src_offset: int
    dst_offset: int
    numel: int
    src_dtype: DType
    count: int = 1
    src_stride: int = 0
    dst_stride: int = 0


@dataclass(eq=False)
class Storage:
    """`nbytes` bytes of one dtype: zeros except what `copies` fill."""

    dtype: DType
    nbytes: int
    copies: list[Copy] = field(default_factory=list)

    def locate(self, element: int) -> tuple[str | bytes | memoryview, int]:
        """(source, byte offset) of element `element` of a storage read from a file or memory."""
        return self.copies[0].source, self.copies[0].src_offset + element * self.dtype.itemsize

    def read(self, start: int = 0, size: int | None = None) -> bytes:
        """`size` bytes (default: to the end) from byte `start` of a storage read from a file or memory."""
        size = self.nbytes - start if size is None else size
        source, offset = self.locate(0) if size else (b"", 0)
        return bytes(read_at(source, offset + start, size))

    def same_bytes(self, other: Storage) -> bool:
        """Whether two storages hold the same bytes (compared WINDOW_BYTES at a time)."""
        windows = [(start, min(WINDOW_BYTES, self.nbytes - start)) for start in range(0, self.nbytes, WINDOW_BYTES)]
        return self.nbytes == other.nbytes and all(self.read(*w) == other.read(*w) for w in windows)


@dataclass(eq=False)
class TensorRef:
    """A tensor as torch's pickle describes it: a view (offset, shape, stride) of a storage, whose element e lies
    at `storage.locate(storage_offset + e)`. It has what checkpoint code needs of torch.Tensor, nothing more."""

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

    def is_contiguous(self) -> bool:
        expected = _contiguous(self.shape)
        return all(dim == 1 or step == want for dim, step, want in zip(self.shape, self.stride, expected))

    def compact(self, shape: Sequence[int] | None = None) -> TensorRef:
        """A contiguous copy (of `shape`, default the same) with a storage of just its elements."""
        if not self.is_contiguous():
            raise ValueError("compact() of a non-contiguous tensor")
        out = TensorRef.empty(self.shape if shape is None else shape, self.dtype)
        if self.numel():
            out.storage.copies.append(Copy(*self.storage.locate(self.storage_offset), 0, self.numel(), self.dtype))
        return out

    def value(self) -> int | float | bool:
        """The number a one-element tensor holds."""
        source, offset = self.storage.locate(self.storage_offset) if self.numel() == 1 else ("", 0)
        if isinstance(source, str):
            raise ValueError("value() of a tensor whose bytes were not read")
        return self.dtype.unpack(bytes(source[offset : offset + self.dtype.itemsize]))[0]

    @classmethod
    def empty(cls, shape: Sequence[int], dtype: DType) -> TensorRef:
        """A new compact tensor of zeros; add `storage.copies` to fill it."""
        shape = Size(shape)
        return cls(Storage(dtype, shape.numel() * dtype.itemsize), 0, shape, _contiguous(shape))


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


class Opaque:
    """An object of a global the reader does not resolve, kept as its pickle built it.

    One subclass per global and file (`module`, `qualname`), standing for the global where a
    pickle uses it as a value. An instance holds the `args` of the REDUCE (`called`) or NEWOBJ
    that made it (and the `kwargs` of a NEWOBJ_EX), the `state` BUILD gave it (None: no BUILD),
    and the `items` and `entries` APPEND(S) and SETITEM(S) added. Nothing of the original class runs.
    """

    module: ClassVar[str] = ""
    qualname: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.args, obj.kwargs, obj.called, obj.state, obj.items, obj.entries = args, kwargs, False, None, [], []
        return obj

    def __init__(self, *args: Any) -> None:
        self.called = True  # a REDUCE calls the class; a NEWOBJ only makes the object

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any) -> Opaque:
        """A REDUCE of a carried object (a functools.partial: how protocol 2 pickles keyword arguments): its result."""
        result = _Called(*args)
        result.callee, result.called = self, True
        return result

    def __deepcopy__(self, memo: dict) -> Opaque:  # `copy`'s default would rebuild it through __new__/__setstate__
        obj = object.__new__(type(self))
        memo[id(self)] = obj
        obj.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return obj

    def append(self, item: Any) -> None:
        self.items.append(item)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries.append((key, value))

    def __repr__(self) -> str:
        return f"<{self.module}.{self.qualname} (carried, not loaded)>"


class _Called(Opaque):
    """What calling a carried object returned: pickled as that call."""


def opaque_class(module: str, qualname: str) -> type[Opaque]:
    """A fresh stand-in class for the global `module.qualname`."""
    return type(qualname.rsplit(".", 1)[-1], (Opaque,), {"module": module, "qualname": qualname})


# ---------------------------------------------------------------------------------------------
# Reading


class Record(NamedTuple):
    offset: int  # of the data in the file
    size: int
    crc: int  # as the zip directory says; 0 when the writer stored none


def read_at(source: str | int | bytes | memoryview, offset: int, size: int, *,
            reuse: bool = False) -> bytearray | memoryview:
    """`size` bytes at `offset` of a file (by path, or an open descriptor) or of bytes in memory; a file's in a new
    buffer, or with `reuse` in this thread's read buffer (see `_thread_buffer`), valid until its next such read."""
    if not isinstance(source, (str, int)):
        return memoryview(source)[offset : offset + size]
    out = _thread_buffer("read", size) if reuse else bytearray(size)
    with open(source, "rb", closefd=isinstance(source, str)) as f:
        pos = 0
        while pos < size:
            n = os.preadv(f.fileno(), [memoryview(out)[pos:]], offset + pos)
            if n == 0:
                raise ended_early(source if isinstance(source, str) else None)
            pos += n
    return out


def ended_early(path: str | None) -> CheckpointLoadError:
    """An input that ends before the bytes its records promise: changed (cut short) since it was read."""
    return CheckpointLoadError(f"{path or 'an input'} ended early while being read (another process changed it?); "
                               "rerun once nothing writes to it")


def zip_records(source: str | bytes) -> dict[str, Record]:
    """Every record of a torch zip checkpoint, by name without the archive folder (`data.pkl`, `data/0`).

    Raises NeedsTorch for a file that is not a zip (torch's legacy format, or not a
    checkpoint at all) and CheckpointLoadError for a damaged one.
    """
    try:
        with open(source, "rb") if isinstance(source, str) else io.BytesIO(source) as f:
            if f.read(4) != b"PK\x03\x04":
                raise NeedsTorch("not a zip file")
            file_size = f.seek(0, os.SEEK_END)
            with zipfile.ZipFile(f) as archive:
                infos = archive.infolist()
            if not infos or "/" not in infos[0].filename:
                raise NeedsTorch("a zip file but not a torch checkpoint")
            prefix, records = infos[0].filename.split("/", 1)[0] + "/", {}
            for info in infos:
                if not info.filename.startswith(prefix) or info.compress_type != zipfile.ZIP_STORED:
                    raise NeedsTorch(f"record {info.filename} is compressed or outside {prefix}")
                f.seek(info.header_offset)
                signature, name_len, extra_len = struct.unpack("<4s22xHH", f.read(30))  # ..., name and extra lengths
                if signature != b"PK\x03\x04" or f.read(name_len) != info.orig_filename.encode():
                    raise zipfile.BadZipFile(f"bad local header of {info.filename}")
                extra, pos = f.read(extra_len), 0
                while pos + 4 <= len(extra):  # (id, size) fields that fill it exactly: else its length is damaged
                    pos += 4 + struct.unpack_from("<HH", extra, pos)[1]
                if pos != extra_len:
                    raise zipfile.BadZipFile(f"bad local header of {info.filename}")
                if info.filename[len(prefix):] in records:  # torch would read one of them, this reader another
                    raise zipfile.BadZipFile(f"record {info.filename} appears twice")
                start = info.header_offset + 30 + name_len + extra_len
                if start + info.file_size > file_size:
                    raise zipfile.BadZipFile(f"record {info.filename} runs past the end of the file")
                records[info.filename[len(prefix):]] = Record(start, info.file_size, info.CRC)
            return records
    except FileNotFoundError:
        raise CheckpointLoadError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise CheckpointLoadError(f"{source}: a folder, not a checkpoint file") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
            struct.error) as e:
        text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        if text == "File is not a zip file":
            text = "no zip directory at its end, so it is truncated"
        elif isinstance(e, UnicodeDecodeError):
            text = "a garbled record name in its zip directory"
        else:
            text = f"{type(e).__name__}: {text}" if text else type(e).__name__
        raise _corrupt(source, text) from None


def _corrupt(source: str | bytes, detail: str) -> CheckpointLoadError:
    where = source if isinstance(source, str) else "<in memory>"
    return CheckpointLoadError(f"{where}: corrupt checkpoint ({detail}); restore the file from a good copy")


def check_record(source: str | bytes, name: str, record: Record, *, keep: bool = False) -> bytes:
    """Read a record and check it against its CRC32 (unless the writer stored none); its bytes if `keep`."""
    offset, size, crc = record
    data = bytes(read_at(source, offset, size)) if keep else b""
    if crc and crc != (zlib.crc32(data) if keep else _crc32_at(source, offset, size)):
        raise _corrupt(source, f"record {name} fails its CRC32 check")
    return data


def _crc32_at(source: str | int | bytes | memoryview, offset: int, size: int) -> int:
    """The CRC32 of `size` bytes at `offset` (a source as `read_at` takes), read in WINDOW_BYTES windows
    through this thread's reused buffer."""
    found = 0
    for start in range(0, size, WINDOW_BYTES):
        found = zlib.crc32(read_at(source, offset + start, min(WINDOW_BYTES, size - start), reuse=True), found)
    return found


def _rebuild_tensor(storage: Storage, storage_offset: int, size: tuple, stride: tuple, requires_grad: bool,
                    backward_hooks: Any, metadata: Any = None) -> TensorRef:
    if backward_hooks or metadata:
        raise NeedsTorch("tensor with hooks or metadata")
    if storage_offset < 0 or any(d < 0 for d in size) or any(s < 0 for s in stride) or len(size) != len(stride):
        raise pickle.UnpicklingError("tensor with a negative offset, size or stride")
    ref = TensorRef(storage, storage_offset, Size(size), tuple(stride), bool(requires_grad))
    last = storage_offset + sum((d - 1) * s for d, s in zip(size, stride)) if ref.numel() else -1
    if last >= storage.nbytes // storage.dtype.itemsize:
        raise pickle.UnpicklingError("tensor beyond its storage")
    return ref


def _rebuild_parameter(data: Any, requires_grad: bool, backward_hooks: Any) -> TensorRef:
    """An nn.Parameter: its tensor (written back as a tensor, as state dicts hold them)."""
    if type(data) is not TensorRef or backward_hooks:
        raise NeedsTorch("parameter with hooks, or not of a tensor")
    return replace(data, requires_grad=bool(requires_grad))


class _StorageTag(NamedTuple):  # what a storage class global resolves to
    dtype: DType


class _Function(NamedTuple):
    """What a function global of the format resolves to: called as it, and written back as that global where a
    pickle holds it as a value (torch pickles a tensor with attributes as a call with `_rebuild_tensor_v2`)."""

    module: str
    name: str
    function: Callable[..., Any]

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)


# The globals a pickle may have resolved. Each lookup returns a fresh object: BUILD can set
# attributes on what a pickle names, and it must not reach anything shared with other files.
_GLOBALS: dict[tuple[str, str], Callable[[], Any]] = {
    ("collections", "OrderedDict"): lambda: collections.OrderedDict,  # a class: BUILD cannot change it
    ("torch._utils", "_rebuild_tensor_v2"): lambda: _Function("torch._utils", "_rebuild_tensor_v2", _rebuild_tensor),
    ("torch._utils", "_rebuild_parameter"): lambda: _Function("torch._utils", "_rebuild_parameter",
                                                              _rebuild_parameter),
    ("torch", "Size"): lambda: Size,
    ("_codecs", "encode"): lambda: _Function("_codecs", "encode", lambda text, encoding="utf-8":  # bytes
                                             codecs.encode(text, encoding)),
    ("__builtin__", "bytes"): lambda: _Function("__builtin__", "bytes", lambda: b""),  # an empty bytes object
}
_GLOBALS.update({("torch", d.storage): (lambda d=d: _StorageTag(d)) for d in _DTYPES})
_GLOBALS.update({("torch", d.name): (lambda d=d: replace(d)) for d in _DTYPES})


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, records: dict[str, Record], source: str | bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.records, self.source = records, source
        self.storages: dict[str, Storage] = {}
        self.opaque: dict[tuple[str, str], type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GLOBALS:
            return _GLOBALS[module, name]()
        if (module, name) in (("__builtin__", "getattr"), ("builtins", "getattr")):  # a nested class, at protocol 2
            return lambda parent, *rest: self._nested(parent, *rest) or self._opaque(module, name)(parent, *rest)
        return self._opaque(module, name)

    def _opaque(self, module: str, name: str) -> type[Opaque]:
        return self.opaque.setdefault((module, name), opaque_class(module, name))

    def _nested(self, parent: Any, *rest: Any) -> type[Opaque] | None:
        """`getattr(Outer, "Inner")` of a stand-in class: the stand-in of `Outer.Inner` (what protocol 2 pickles
        for it); None for any other getattr."""
        if not (isinstance(parent, type) and issubclass(parent, Opaque) and len(rest) == 1 and type(rest[0]) is str):
            return None
        return self._opaque(parent.module, f"{parent.qualname}.{rest[0]}")

    def persistent_load(self, pid: Any) -> Storage:
        if isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[1], type) and issubclass(pid[1], Opaque):
            where = self.source if isinstance(self.source, str) else "<in memory>"
            raise CheckpointLoadError(f"{where}: holds tensors of torch.{pid[1].qualname} (complex, uint16-64, "
                                      "float8 or quantized dtypes), which resharding does not support; convert "
                                      "them first, e.g. with .float()")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageTag)):
            raise pickle.UnpicklingError(f"persistent id {pid!r:.60}")
        _, tag, key, _location, numel = pid  # location (e.g. cuda:0) dropped: cpu, as map_location="cpu" does
        if key not in self.storages:
            record = self.records.get(f"data/{key}", Record(-1, -1, 0))
            source, offset, size = self.source, record.offset, record.size
            if size != numel * tag.dtype.itemsize:
                raise pickle.UnpicklingError(f"storage {key}: record of {size} bytes for {numel} elements")
            if 0 < size <= SMALL_BYTES and isinstance(source, str):  # small values (`step`): value() needs no file
                source, offset = check_record(source, f"data/{key}", record, keep=True), 0
            self.storages[key] = Storage(tag.dtype, size, [Copy(source, offset, 0, numel, tag.dtype)] if size else [])
        return self.storages[key]


def read_checkpoint(source: str | os.PathLike | bytes) -> tuple[Any, list[str]]:
    """The checkpoint's object with `TensorRef`s for tensors, and the globals it keeps as `Opaque`.

    `source` is a file path (only the zip directory, the pickle and storages of at most
    SMALL_BYTES are read: no tensor data) or a whole file in memory. Raises NeedsTorch
    (see the module docstring) or CheckpointLoadError.
    """
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    name = source if isinstance(source, str) else "<in memory>"
    records = zip_records(source)
    if "data.pkl" not in records:
        raise NeedsTorch("no data.pkl record")
    if "byteorder" in records and check_record(source, "byteorder", records["byteorder"], keep=True) != b"little":
        raise NeedsTorch("big-endian file")
    unpickler = _Unpickler(check_record(source, "data.pkl", records["data.pkl"], keep=True), records, source)
    try:
        obj = unpickler.load()
    except (NeedsTorch, CheckpointLoadError):
        raise
    except Exception as e:  # noqa: BLE001 -- a pickle the zip CRC32 did not catch (or saved without one)
        raise CheckpointLoadError(
            f"{name}: cannot read checkpoint (unpickling failed: {type(e).__name__}: {str(e)[:100]}); "
            "the file is truncated, corrupt or not a torch checkpoint"
        ) from None
    return obj, sorted(f"{m}.{n}" for m, n in unpickler.opaque)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive in the block reach their handlers when it is done: for code that must not be
    cut short by what a handler raises. Python runs handlers in the main thread only, so elsewhere this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    handlers = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in handlers.items():  # None: one not set from Python, which cannot be put back
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def import_torch() -> Any:
    """torch, imported with the signals held (`signals_held`): torch's import swallows a KeyboardInterrupt, or what
    a SIGTERM handler raises, that arrives during it, and the run would go on."""
    with signals_held() if "torch" not in sys.modules else contextlib.nullcontext():
        import torch
    return torch


def from_torch(obj: Any) -> tuple[Any, list[str]]:
    """What `read_checkpoint` gives for `obj` as `torch.load` returned it: saved by torch into memory, read back."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return read_checkpoint(buffer.getvalue())


def _gather(copies: Sequence[Copy], lo: int, out: memoryview, dtype: DType) -> None:
    """Fill `out`, bytes [lo, lo + len(out)) of a storage of `dtype`, from `copies` (all inside it); zeros elsewhere.

    Each source is read in windows of up to WINDOW_BYTES that cover many copies at once
    (a model-parallel cut makes many small ones), so reads are few whatever the copies,
    into a buffer this thread reuses; rows go from there to `out` in one strided copy each.
    """
    import numpy as np

    def strided(data: Any, offset: int, count: int, row: int, stride: int) -> Any:
        """`count` rows of `row` bytes, `stride` apart (0: end to end), of the uint8 array `data` from `offset`."""
        return np.lib.stride_tricks.as_strided(data[offset:], (count, row), (stride or row, 1))

    target = np.frombuffer(out, np.uint8)
    if sum(c.numel * c.count for c in copies) * dtype.itemsize < len(out):  # copies do not cover it all
        target.fill(0)
    for start, end, run in _runs(copies, lambda c: (id(c.source), c.src_offset, c.count,
                                                    c.numel * c.src_dtype.itemsize, c.src_stride)):
        data = np.frombuffer(read_at(run[0].source, start, end - start, reuse=True), np.uint8)
        for copy in run:
            src_row, dst_row = copy.numel * copy.src_dtype.itemsize, copy.numel * dtype.itemsize
            rows = strided(data, copy.src_offset - start, copy.count, src_row, copy.src_stride)
            if copy.src_dtype != dtype:
                rows = np.frombuffer(_cast(np.ascontiguousarray(rows), copy.src_dtype, dtype), np.uint8)
            strided(target, copy.dst_offset - lo, copy.count, dst_row, copy.dst_stride)[...] = (
                rows.reshape(copy.count, dst_row))


_THREAD = threading.local()


def _thread_buffer(name: str, size: int) -> memoryview:
    """`size` bytes of this thread's WINDOW_BYTES buffer `name`, reused from call to call (a fresh
    buffer for every window would cost a page fault per page); a fresh one if larger. It is an anonymous
    mmap, so only the pages used become resident, and they go back to the system with the thread."""
    if size > WINDOW_BYTES:
        return memoryview(bytearray(size))
    buffer = getattr(_THREAD, name, b"")
    if len(buffer) != WINDOW_BYTES:
        buffer = mmap.mmap(-1, WINDOW_BYTES)
        setattr(_THREAD, name, buffer)
    return memoryview(buffer)[:size]


def _runs(copies: Sequence[Copy], where: Callable[[Copy], tuple[int, ...]]) -> Iterator[tuple[int, int, list[Copy]]]:
    """(lo, hi, copies): `copies` by where they lie, `where(copy)`: (group, offset, count, row, stride), `count`
    rows of `row` bytes `stride` apart (0: end to end); grouped into ranges [lo, hi) of one group and at most
    WINDOW_BYTES (a copy longer than that comes alone), in order of group and offset."""
    run: list[Copy] = []
    for copy in sorted(copies, key=lambda c: where(c)[:2]):
        group, start, count, row, stride = where(copy)
        end = start + (count - 1) * (stride or row) + row
        if run and (group != run_group or end - lo > WINDOW_BYTES):
            yield lo, hi, run
            run = []
        if not run:
            run_group, lo, hi = group, start, start
        run.append(copy)
        hi = max(hi, end)
    if run:
        yield lo, hi, run


def _cast(data: bytes | memoryview, src: DType, dst: DType) -> bytes:
    """`data`'s elements cast; raises OverflowError where a finite value would become inf (beyond float16's range).
    A NaN becomes the standard NaN of its sign: torch's cast gives other bits in other chunks of one tensor."""
    import torch  # only casting needs it

    values = torch.frombuffer(bytearray(data), dtype=getattr(torch, src.name))
    out = values.to(getattr(torch, dst.name))
    if dst.is_floating_point and out.numel() and not out.abs().max() < math.inf:  # an inf or NaN: which? (slower)
        grown = out.isinf() & values.isfinite()
        if grown.any():
            raise OverflowError(f"{int(grown.sum())} finite {src.name} value(s) up to {values[grown].abs().max():.6g} "
                                f"would become inf in {dst.name}")
        nan, ints = out.isnan(), {2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
        standard = torch.tensor(math.nan, dtype=out.dtype).view(ints)  # its sign set by bits (bfloat16's neg keeps it)
        out.view(ints)[nan] = torch.where(values[nan].signbit(), standard | torch.iinfo(ints).min, standard)
    return out.view(torch.uint8).numpy().tobytes()


def to_torch(obj: Any, storages: dict[Any, Any] | None = None, *, mmap: bool = False) -> Any:
    """`obj` with torch tensors for its TensorRefs (read from their sources; shared storages stay shared). With
    `mmap`, a storage that is one run of a file's bytes is mapped from it, as `torch.load(mmap=True)` does."""
    import torch

    storages = {} if storages is None else storages  # Storage id (or a file's path) -> a flat torch tensor
    if type(obj) is TensorRef:
        dtype, copies = getattr(torch, obj.dtype.name), obj.storage.copies
        whole = len(copies) == 1 and copies[0][2:6] == (0, obj.storage.nbytes // obj.dtype.itemsize, obj.dtype, 1)
        whole = whole and isinstance(copies[0].source, str) and not copies[0].src_offset % obj.dtype.itemsize
        if mmap and whole and id(obj.storage) not in storages:  # a view of the file's map
            if copies[0].source not in storages:
                size = os.path.getsize(copies[0].source)
                storages[copies[0].source] = torch.from_file(copies[0].source, shared=False, size=size,
                                                             dtype=torch.uint8)
            start = copies[0].src_offset
            storages[id(obj.storage)] = storages[copies[0].source][start : start + obj.storage.nbytes].view(dtype)
        if id(obj.storage) not in storages:  # its copies read (and cast), zeros elsewhere
            data = bytearray(obj.storage.nbytes)
            _gather(obj.storage.copies, 0, memoryview(data), obj.storage.dtype)
            storages[id(obj.storage)] = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        base = storages[id(obj.storage)]
        return base.as_strided(obj.shape, obj.stride, base.storage_offset() + obj.storage_offset)
    if type(obj) is Size:
        return torch.Size(obj)
    if type(obj) is DType:
        return getattr(torch, obj.name)
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, to_torch(v, storages, mmap=mmap)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(to_torch(v, storages, mmap=mmap) for v in obj)
    return obj


# ---------------------------------------------------------------------------------------------
# Writing: the pickle


_marker = functools.cache(opaque_class)  # one stand-in per global of the format, so the memo writes it once
_PICKLED = {type(None), bool, int, float, str, bytes, tuple, list, dict, collections.OrderedDict, set, frozenset,
            bytearray, type, type(codecs.encode)}  # classes and functions: Opaque and format globals, `_codecs.encode`


def _global_of(obj: Any) -> Any:
    """The stand-in class (`_marker`) of the format global `obj` is read as, or `obj` itself."""
    if type(obj) in (DType, _StorageTag):  # a dtype or storage class is the global torch.<name>
        return _marker("torch", obj.name if type(obj) is DType else obj.dtype.storage)
    if type(obj) is _Function:
        return _marker(obj.module, obj.name)
    return _marker("torch", "Size") if obj is Size else obj


class _Pickler(pickle._Pickler):
    """The protocol-2 pickle torch.save writes (with Python's own pickler, whose `save_global` can write
    globals this module stands in for). Storages are persistent ids ('storage', torch.<X>Storage, key,
    'cpu', numel), keys "0", "1", ... in order of first use; shared objects (tied weights) stay shared."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        super().__init__(self.buffer, protocol=2)
        self.storages: dict[int, tuple[str, Storage]] = {}

    def dump(self, obj: Any) -> bytes:
        super().dump(obj)
        return self.buffer.getvalue()

    def persistent_id(self, obj: Any) -> tuple | None:
        if type(obj) is not Storage:
            return None
        key, _ = self.storages.setdefault(id(obj), (str(len(self.storages)), obj))
        return "storage", _marker("torch", obj.dtype.storage), key, "cpu", obj.nbytes // obj.dtype.itemsize

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _PICKLED:  # first: most objects are
            return NotImplemented
        if kind is TensorRef:
            args = (obj.storage, obj.storage_offset, tuple(obj.shape), tuple(obj.stride), obj.requires_grad)
            return _marker("torch._utils", "_rebuild_tensor_v2"), (*args, collections.OrderedDict())
        if kind is Size:
            return _marker("torch", "Size"), (tuple(obj),)
        if kind in (DType, _StorageTag, _Function):
            return "global"  # save_global writes the global it stands for
        if isinstance(obj, Opaque):  # REDUCE, or NEWOBJ; BUILD only for a state that is not None
            rest = (obj.state, iter(obj.items), iter(obj.entries))
            if kind is _Called:
                return (obj.callee, tuple(obj.args), *rest)
            if obj.kwargs:
                return (copyreg.__newobj_ex__, (kind, tuple(obj.args), obj.kwargs), *rest)
            return (kind, tuple(obj.args), *rest) if obj.called else (copyreg.__newobj__, (kind, *obj.args), *rest)
        raise TypeError(f"cannot write a {kind.__name__} into a checkpoint")

    def save_reduce(self, func: Any, args: Any, *rest: Any, obj: Any = None) -> None:
        """Python's, but an object made with keyword arguments is written with NEWOBJ_EX, as the input's pickle
        (protocol 4 or later) made it: protocol 2 writes a partial of the class's `__new__`, which a stand-in lacks."""
        if func is not copyreg.__newobj_ex__:
            return super().save_reduce(func, args, *rest, obj=obj)
        self.proto = 4  # that object (and what it holds) in protocol 4's opcodes, which every unpickler reads
        try:
            return super().save_reduce(func, args, *rest, obj=obj)
        finally:
            self.proto = 2

    def save_global(self, obj: Any, name: str | None = None) -> None:
        stand_in = _global_of(obj)
        if not (isinstance(stand_in, type) and issubclass(stand_in, Opaque)):  # Opaque, or a format global (`_marker`)
            return super().save_global(obj, name)
        if "." in stand_in.qualname:  # a nested class: as Python's pickler writes it at protocol 2
            parent, attr = stand_in.qualname.rsplit(".", 1)
            return self.save_reduce(getattr, (_marker(stand_in.module, parent), attr), obj=obj)
        self.write(f"c{stand_in.module}\n{stand_in.qualname}\n".encode())
        self.memoize(obj)


# ---------------------------------------------------------------------------------------------
# Writing: the zip file


@dataclass
class _Entry:
    name: bytes
    size: int
    data: bytes = b""  # small records; storages are copied in
    storage: Storage | None = None
    crc: int = 0
    header_offset: int = 0
    data_offset: int = 0


def _header(entry: _Entry, central: bool = False) -> bytes:
    """The entry's local header, padded so that its data starts at a multiple of ALIGNMENT; or with `central`,
    its central directory entry. As torch's writer (miniz) does: sizes and the header's offset too big for their
    fields go into a zip64 extra field, in both; the local header leaves CRC and sizes to the data descriptor
    after the data (none after an empty record). `torch.load` may compute offsets from that layout."""
    values = [entry.size, entry.size, entry.header_offset]
    big = [v for v in values if v >= ZIP64_LIMIT]
    extra = struct.pack(f"<HH{len(big)}Q", 1, 8 * len(big), *big) if big else b""
    if not central:
        pad = -(entry.header_offset + 30 + len(entry.name) + len(extra) + 4) % ALIGNMENT  # 4: the field's header
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": torch's padding field
    version, flags = 45 if big else 20, 0x808 if entry.size else 0x800  # UTF-8 names; bit 3: a data descriptor
    shown = [_ZIP64_MARK if v >= ZIP64_LIMIT else v for v in values] if central else [0, 0, 0]
    crc = entry.crc if central else 0
    fields = struct.pack("<HHHHHIIIHH", version, flags, 0, 0, 33, crc, *shown[:2], len(entry.name), len(extra))
    if central:  # version made by first; then comment length, disk, attributes, the local header's offset
        fields = struct.pack("<H", version) + fields + struct.pack("<HHHII", 0, 0, 0, 0, shown[2])
    return (b"PK\x01\x02" if central else b"PK\x03\x04") + fields + entry.name + extra


def _descriptor(entry: _Entry) -> bytes:
    """The data descriptor after a record's data: its CRC32 and sizes (8 bytes each where the entry is zip64)."""
    if not entry.size:
        return b""
    wide = entry.size >= ZIP64_LIMIT or entry.header_offset >= ZIP64_LIMIT
    return struct.pack("<4sI" + ("QQ" if wide else "II"), b"PK\x07\x08", entry.crc, entry.size, entry.size)


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """zip64 end record and locator (always, as torch writes them), then the classic end record."""
    out = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_offset + cd_size, 1)  # where the zip64 end record is
    small = [min(count, 0xFFFF), min(cd_size, _ZIP64_MARK), min(cd_offset, _ZIP64_MARK)]
    return out + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, small[0], small[0], small[1], small[2], 0)


def pickle_bytes(obj: Any) -> bytes:
    """The pickle `write_checkpoint` writes for `obj` (tensors as storage references): to compare objects."""
    return _Pickler().dump(obj)


def _entries(obj: Any) -> list[_Entry]:
    pickler = _Pickler()

    def small(name: str, data: bytes) -> _Entry:
        return _Entry(f"archive/{name}".encode(), len(data), data, crc=zlib.crc32(data))

    entries = [small("data.pkl", pickler.dump(obj)), small(".format_version", b"1"),  # dump() fills .storages
               small(".storage_alignment", str(ALIGNMENT).encode()), small("byteorder", b"little")]
    entries += [_Entry(f"archive/data/{key}".encode(), s.nbytes, storage=s) for key, s in pickler.storages.values()]
    serialization_id = str(int.from_bytes(os.urandom(16), "little")).zfill(40)[:40].encode()
    return entries + [small("version", b"3\n"), small(".data/serialization_id", serialization_id)]


def write_checkpoint(fd: int, obj: Any, *, crc32: bool = False, report: Report | None = None) -> int:
    """Write `obj` as a torch checkpoint to the empty file `fd`; returns the file size.

    Storages are filled from their copies: `copy_file_range` from files (input by input,
    in file order: one input open at a time, read front to back), cast chunk by chunk
    where the dtype changes; bytes no copy covers are zeros. Storage records get CRC32s
    only with `crc32` (read back once written; torch never checks them). `report(nbytes)`
    is called as storage bytes are written.
    """
    entries = _entries(obj)
    offset = 0
    for entry in entries:
        entry.header_offset = offset
        entry.data_offset = offset + len(_header(entry))
        offset = entry.data_offset + entry.size + len(_descriptor(entry))
    os.ftruncate(fd, offset)  # what no copy covers (padding, zeros) is never written: it reads as zeros
    by_source: dict[str, list[tuple[Copy, _Entry]]] = {}  # input file: copies from it, and their entries
    for entry in entries:
        for copy in _gathered(fd, entry, report) if entry.storage else ():
            if isinstance(copy.source, str):
                by_source.setdefault(copy.source, []).append((copy, entry))
            else:
                _copy_chunks(copy, -1, fd, entry, report)
    for path, copies in by_source.items():
        src = os.open(path, os.O_RDONLY)
        try:
            for copy, entry in sorted(copies, key=lambda c: c[0].src_offset):
                _copy_chunks(copy, src, fd, entry, report)
        finally:
            os.close(src)
    for entry in entries:
        if crc32 and entry.storage:
            entry.crc = _crc32_at(fd, entry.data_offset, entry.size)
        pwrite_all(fd, _header(entry) + entry.data, entry.header_offset)
        pwrite_all(fd, _descriptor(entry), entry.data_offset + entry.size)
    cd = b"".join(_header(e, central=True) for e in entries)
    tail = cd + _end_records(len(entries), offset, len(cd))
    pwrite_all(fd, tail, offset)
    return offset + len(tail)


def _gathered(fd: int, entry: _Entry, report: Report | None) -> list[Copy]:
    """Write what is gathered in memory of a storage (rows of a model-parallel cut, many small copies), in
    windows of at most WINDOW_BYTES; the copies left to copy one by one (file to file where they can)."""
    storage, itemsize = entry.storage, entry.storage.dtype.itemsize
    rows = any(c.count > 1 for c in storage.copies)  # a model-parallel cut on the second dim
    if not rows and (len(storage.copies) <= MANY_COPIES or storage.nbytes > WINDOW_BYTES):
        return storage.copies  # also a big storage of many plain copies (256 -> 1): input by input
    pieces, plain = [], []
    for copy in storage.copies:  # repeating copies: as many rows at a time as fit a window, in output and input
        pitch = copy.dst_stride or copy.numel * itemsize
        per = max(1, WINDOW_BYTES // max(pitch, copy.src_stride)) if copy.count > 1 else 1
        pieces += [copy._replace(src_offset=copy.src_offset + first * copy.src_stride,
                                 dst_offset=copy.dst_offset + first * pitch, count=min(per, copy.count - first))
                   for first in range(0, copy.count, per)]
    for lo, hi, group in _runs(pieces, lambda c: (0, c.dst_offset, c.count, c.numel * itemsize, c.dst_stride)):
        if len(group) == 1 and group[0].count == 1:  # one big copy: file to file
            plain += group
        else:
            window = _thread_buffer("window", hi - lo)
            _gather(group, lo, window, storage.dtype)
            pwrite_all(fd, window, entry.data_offset + lo, report)
    return plain


def _copy_chunks(copy: Copy, src: int, fd: int, entry: _Entry, report: Report | None) -> None:
    """One copy into the entry's storage; `src` is its source's open file, if any."""
    dtype, dst = entry.storage.dtype, entry.data_offset + copy.dst_offset
    if copy.src_dtype == dtype and src >= 0:
        try:
            copy_file_range_all(src, fd, copy.numel * dtype.itemsize, copy.src_offset, dst, report)
        except CheckpointLoadError:  # ended early: name it
            raise ended_early(str(copy.source)) from None
        return
    step = CAST_BYTES // max(copy.src_dtype.itemsize, dtype.itemsize)
    for first in range(0, copy.numel, step):
        count = min(step, copy.numel - first)
        data = read_at(copy.source, copy.src_offset + first * copy.src_dtype.itemsize, count * copy.src_dtype.itemsize)
        if copy.src_dtype != dtype:
            data = _cast(data, copy.src_dtype, dtype)
        pwrite_all(fd, data, dst + first * dtype.itemsize, report)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int, report: Report | None = None) -> None:
    """Write all of `data` at `offset`, CHUNK_BYTES per call, starting each chunk's writeback."""
    view = memoryview(data).cast("B")
    pos = 0
    while pos < len(view):
        n = os.pwrite(fd, view[pos : pos + CHUNK_BYTES], offset + pos)
        _written(fd, offset + pos, n, report)
        pos += n


_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF}


def copy_file_range_all(src: int, dst: int, nbytes: int, src_offset: int, dst_offset: int,
                        report: Report | None = None) -> None:
    """Copy bytes between files in the kernel (page cache to page cache), or by pread/pwrite where unsupported."""
    use_kernel = hasattr(os, "copy_file_range")
    while nbytes:
        step = min(nbytes, CHUNK_BYTES)
        if use_kernel:
            try:
                n = os.copy_file_range(src, dst, step, src_offset, dst_offset)
            except OSError as e:
                if e.errno not in _NO_COPY_FILE_RANGE:
                    raise
                use_kernel = False
        if not use_kernel:
            n = os.pwrite(dst, os.pread(src, step, src_offset), dst_offset)  # a short write: the rest next round
        if n == 0:
            raise ended_early(None)
        _written(dst, dst_offset, n, report)
        nbytes, src_offset, dst_offset = nbytes - n, src_offset + n, dst_offset + n


def _written(fd: int, offset: int, length: int, report: Report | None) -> None:
    """Report bytes just written and start their writeback now, so the final fsync finds little left (on Linux,
    POSIX_FADV_DONTNEED on dirty pages starts it without waiting, and drops only pages already clean)."""
    if report is not None:
        report(length)
    if length >= CHUNK_BYTES // 4 and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
