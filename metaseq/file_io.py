"""Checkpoint file naming and I/O shared by training, resharding and inference.

Only I/O lives here: no tensor math. Every writer goes through `atomic_torch_save`
(or `atomic_output`) so that a crash never leaves a partial file at a final path.
torch is imported by the functions that need it, not with this module: the reshard
CLI usually runs without torch at all (see `metaseq.torchzip`).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping

__all__ = [
    "CheckpointLoadError",
    "atomic_output",
    "atomic_torch_save",
    "check_checkpoint_crc",
    "load_checkpoint",
    "load_checkpoint_skeleton",
    "skeleton",
    "natural_sort_key",
    "remove_stale_temp_files",
    "save_to_file",
    "shard_file_name",
]

logger = logging.getLogger(__name__)

CRC_CHUNK_BYTES = 16 << 20

# Types this project's checkpoints may contain besides tensors and builtins.
# torch.Size (shapes in shard_metadata) is allowed by torch already.
SAFE_GLOBALS = [argparse.Namespace]


_UMASK = os.umask(0o022)  # read once, while importing (single-threaded): os.umask can only be read by setting it
os.umask(_UMASK)


class CheckpointLoadError(RuntimeError):
    """A checkpoint file could not be read; the message names the file and the fix."""


def shard_file_name(prefix: str, model_part: int, shard: int) -> str:
    """`checkpoint_last` -> `checkpoint_last-model_part-0-shard3.pt` (metaseq's naming)."""
    return f"{prefix}-model_part-{model_part}-shard{shard}.pt"


def natural_sort_key(path: str | os.PathLike) -> list:
    """Sort key that puts `shard10` after `shard2`."""
    parts = re.split(r"(\d+)", str(path))
    return [int(p) if p.isdigit() else p for p in parts]


def atomic_torch_save(obj: Any, path: str | os.PathLike, *, on_write: Callable[[int], None] | None = None) -> None:
    """`torch.save` to a temp file in the target folder, fsync, rename, fsync the folder.

    Either the final path holds the complete file or it is left untouched. The temp
    file is `.NAME.<pid>.<random>.tmp` (hidden, never matched by a `*.pt` glob); ones
    left by killed writers are removed first. A write error such as ENOSPC is raised
    as that OSError (torch would report it as an opaque RuntimeError). `on_write(nbytes)`
    is called after each write to the temp file (progress reporting).
    """
    with atomic_output(path) as (f, _):
        save_to_file(obj, f, on_write)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[tuple[BinaryIO, str]]:
    """Write `path` through a temp file: yields (the temp file open for reading and writing, its path).

    On success the file is flushed, fsync-ed and renamed over `path`, then the folder
    is fsync-ed; on any error the temp file is removed (see `atomic_torch_save`).
    """
    path = Path(path)
    folder = path.parent  # Path("name.pt").parent is Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes it 0600; permissions as `open` would give
        with os.fdopen(fd, "w+b") as f:
            yield f, tmp
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(folder)


class _WriteErrorRecorder:
    """File wrapper for torch.save that remembers the OSError a write raised."""

    def __init__(self, f: BinaryIO, on_write: Callable[[int], None] | None = None) -> None:
        self.f = f
        self.on_write = on_write
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        if self.on_write is not None:
            self.on_write(written)
        return written

    def flush(self) -> None:
        self.f.flush()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """torch.save under `torch.serialization.skip_data` seeks over the records it leaves empty."""
        return self.f.seek(offset, whence)


def save_to_file(obj: Any, f: BinaryIO, on_write: Callable[[int], None] | None = None) -> None:
    """`torch.save(obj, f)`, raising a failed write as its OSError (e.g. ENOSPC)."""
    import torch

    writer = _WriteErrorRecorder(f, on_write)
    try:
        torch.save(obj, writer)
    except RuntimeError:
        if writer.error is not None:  # torch wraps it as "unexpected pos ..."
            raise writer.error from None
        raise


def remove_stale_temp_files(path: str | os.PathLike) -> list[str]:
    """Remove temp files of `path` left by writers that died (killed runs); returns them.

    Only `.NAME.<pid>.<random>.tmp` whose pid no longer runs on this host (and
    `.NAME.<random>.tmp` of older versions, which carry no pid) are removed, so a
    live writer's temp file is never touched.
    """
    path = Path(path)
    folder = path.parent
    stale_re = re.compile(rf"\.{re.escape(path.name)}\.(?:(\d+)\.)?[a-z0-9_]{{8}}\.tmp")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        match = stale_re.fullmatch(name)
        if match is None or (match.group(1) and _pid_alive(int(match.group(1)))):
            continue
        try:
            os.unlink(folder / name)
        except FileNotFoundError:
            continue
        removed.append(str(folder / name))
        logger.warning("removed %s, a temporary file left by a killed run", folder / name)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, owned by someone else
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike, *, mmap: bool = False, trust: bool = False) -> dict:
    """Load one checkpoint file safely.

    By default only tensors, builtins, `torch.Size` and `argparse.Namespace` are
    unpickled (`weights_only=True`). `trust=True` allows arbitrary pickles; only for
    files from a trusted source. `mmap=True` maps tensor storages from disk instead
    of reading them, so memory is spent only on what is touched (files in torch's
    legacy, non-zip format cannot be mapped and are read). The pickle (names, shapes,
    metadata) is checked against its zip CRC32 first; tensor data is not (see
    `check_checkpoint_crc`).
    """
    import torch

    path = str(path)
    mmap = mmap and check_checkpoint_crc(path, tensors=False) is not None
    try:
        if trust:
            obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
        else:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except FileNotFoundError:
        raise CheckpointLoadError(f"{path}: no such file") from None
    except Exception as e:  # unsafe type, truncated, corrupt, not a torch file
        if not trust and "Unsupported global" in str(e):
            raise CheckpointLoadError(
                f"{path}: refusing to unpickle a type outside the checkpoint format "
                f"({_unsupported_global(e)}); if you trust this file, pass --trust-checkpoint"
            ) from None
        raise CheckpointLoadError(
            f"{path}: cannot read checkpoint ({_load_error_detail(e)}); "
            "the file is truncated, corrupt or not a torch checkpoint"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointLoadError(f"{path}: expected a dict checkpoint, found {type(obj).__name__}")
    return obj


def load_checkpoint_skeleton(path: str | os.PathLike, *, trust: bool = False) -> dict:
    """The checkpoint's structure without its tensor data: tensors become meta tensors.

    0-dim tensors (e.g. an optimizer `step`) keep their value. Only the pickle is read
    (the file is mmap-loaded and nothing else is touched).
    """
    return skeleton(load_checkpoint(path, mmap=True, trust=trust))


def skeleton(obj: Any) -> Any:
    """Tensors -> meta tensors (shape and dtype only), 0-dim tensors kept; containers rebuilt."""
    import torch

    if type(obj) in (str, int, float, bool, type(None), torch.Size):  # fast path: most objects are names, shapes
        return obj
    if torch.is_tensor(obj):
        return obj.clone() if obj.dim() == 0 else torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, Mapping):
        return {k: skeleton(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(skeleton(v) for v in obj)
    return obj


def check_checkpoint_crc(path: str | os.PathLike, *, tensors: bool = True) -> int | None:
    """Check a torch zip checkpoint's records against the CRC32s stored in its zip directory.

    torch.load never checks them, so a flipped bit would go unnoticed. With `tensors`
    every record is read (the whole file); without, only the small ones (the pickle,
    version, byteorder), not the tensor storages `<archive>/data/<key>`. Returns the
    number of bytes checked, or None for a file that is not a zip (torch's legacy format
    or garbage: torch.load decides). Records written without a CRC
    (`torch.serialization.set_crc32_options(False)` stores 0) are not checked.
    """
    path = str(path)
    checked = 0
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return None
            with zipfile.ZipFile(f) as archive:
                for info in archive.infolist():
                    if tensors or not _STORAGE_RE.fullmatch(info.filename):
                        checked += _check_record(archive, info)
    except FileNotFoundError:
        raise CheckpointLoadError(f"{path}: no such file") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        detail = _zip_error_detail(e)
        raise CheckpointLoadError(f"{path}: corrupt checkpoint ({detail}); restore the file from a good copy") from None
    return checked


_STORAGE_RE = re.compile(r"[^/]+/data/[^/]+")


def _check_record(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """Read one record; zipfile raises BadZipFile at its end if the CRC32 differs."""
    if info.CRC == 0:
        return 0
    with archive.open(info) as record:
        while record.read(CRC_CHUNK_BYTES):
            pass
    return info.file_size


def _zip_error_detail(e: BaseException) -> str:
    text = _first_line(e)
    crc = re.fullmatch(r"Bad CRC-32 for file '(?:[^/]*/)?(.*)'", text)
    if crc:
        return f"record {crc.group(1)} fails its CRC32 check"
    if text == "File is not a zip file":
        return "no zip directory at its end, so it is truncated"
    if isinstance(e, UnicodeDecodeError):
        return "a garbled record name in its zip directory"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _unsupported_global(e: BaseException) -> str:
    match = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return f"it contains {match.group(1)}" if match else "it needs arbitrary unpickling"


def _load_error_detail(e: BaseException) -> str:
    """Short reason: torch's weights-only errors carry a long preamble, the zip reader a C++ prefix."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = "unpickling failed: " + text.split("WeightsUnpickler error:", 1)[1].strip()
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text.strip())
    first = text.splitlines()[0] if text else ""
    first = first if len(first) <= 100 else first[:97] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else ""
