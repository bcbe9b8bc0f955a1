"""Checkpoint files: their names, finding a set of shards, atomic writes and loading with torch.

Only I/O lives here: no tensor math. Every writer goes through `atomic_output` (or
`atomic_torch_save`), so a crash never leaves a partial file at a final path. torch is
imported by the functions that need it: the reshard CLI runs without it (`metaseq.torchzip`).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import glob
import hashlib
import logging
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

from metaseq.errors import CheckpointLoadError, UserError
from metaseq.torchzip import NeedsTorch, check_record, read_at, zip_records

__all__ = ["CheckpointLoadError", "atomic_link", "atomic_output", "atomic_torch_save", "check_checkpoint_crc",
           "check_no_broken_links", "checkpoint_prefix", "find_model_parts", "find_shards", "folder_hint",
           "glob_files", "is_glob", "load_checkpoint", "model_part_number", "natural_sort_key",
           "pattern_forms", "remove_stale_temp_files", "remove_stale_temp_files_in", "shard_file_name", "shard_glob",
           "summarize_paths"]

logger = logging.getLogger(__name__)

# Types this project's checkpoints may contain besides tensors and builtins.
SAFE_GLOBALS = [argparse.Namespace]

_PART_RE = re.compile(r"model_part-(\d+)")
_TEMP_RE = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp", re.DOTALL)  # .STEM.<pid>.<random>.tmp, or without the pid
_SHARD_RE = re.compile(r"shard(\d+)")


def shard_file_name(prefix: str, model_part: int | str, shard: int | str) -> str:
    """`checkpoint_last` -> `checkpoint_last-model_part-0-shard3.pt` (metaseq's naming)."""
    return f"{prefix}-model_part-{model_part}-shard{shard}.pt"


def checkpoint_prefix(stem: str | os.PathLike) -> str:
    """`DIR/checkpoint_last.pt` (or one of its shard files' names) -> `DIR/checkpoint_last`."""
    return re.sub(r"(?:-model_part-\d+-shard\d+)?(?:\.pt)?$", "", str(stem))


def shard_glob(stem: str | os.PathLike, model_part: int | str = 0) -> str:
    """`DIR/checkpoint_last.pt` (or one of its shard files) -> `DIR/checkpoint_last-model_part-0-shard*.pt`."""
    return shard_file_name(glob.escape(checkpoint_prefix(stem)), model_part, "*")


def natural_sort_key(path: str | os.PathLike) -> list:
    """Sort key that puts `shard10` after `shard2`."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(path))]


def find_shards(pattern: str, *, flag: str = "--input-glob-pattern") -> list[str]:
    """The files `pattern` matches, ordered by shard index: the number after `shard` in metaseq's names, else the
    one number that differs between the names (`out/s0.pt`, `out/s1.pt`, ...); one file is returned as it is."""
    paths = _glob_files(pattern, flag, every_part=False)
    parts = [model_part_number(p) for p in paths]
    if len(set(parts)) > 1:
        if None in parts:
            example = next(p for p, part in zip(paths, parts) if part is not None)
            raise UserError(f"{paths[parts.index(None)]}: not a model part's shard like {example}; "
                            f"narrow {flag} so that it matches only the shards")
        every = (", or every part with '{j}' in both names: '...-model_part-{j}-shard*.pt' and "
                 "'...-model_part-{j}-shard{i}.pt'" if flag == "--input-glob-pattern" else "")  # the reshard tool's
        raise UserError(f"inputs mix model parts {sorted(set(parts))} ({summarize_paths(paths)}); name one model "
                        f"part's files, e.g. {flag} '...-model_part-0-shard*.pt'{every}")
    return _order_shards(paths, flag)


def find_model_parts(pattern: str, *, flag: str = "--input-glob-pattern") -> list[list[str]]:
    """The files `pattern` matches grouped by model part (`model_part-J`), each part's shards ordered.

    Parts must be exactly 0..P-1, each with as many shard files (one, for consolidated files).
    """
    by_part: dict[int, list[str]] = {}
    for path in _glob_files(pattern, flag, every_part=True):
        part = model_part_number(path)
        if part is None:
            raise UserError(f"{path}: no model part ('model_part-J') in its name; narrow {flag} to the parts' "
                            "files, or name each part's files '...-model_part-J...' (J: its part number)")
        by_part.setdefault(part, []).append(path)
    missing = sorted(set(range(max(by_part) + 1)) - set(by_part))
    if missing:
        raise UserError(f"model_part-{missing[0]} is missing: {flag} {pattern!r} matches parts {sorted(by_part)}")
    sharded = {j: any(_SHARD_RE.search(os.path.basename(p)) for p in paths) for j, paths in sorted(by_part.items())}
    if len(set(sharded.values())) > 1:  # one form per checkpoint: a part's file and another's shards do not mix
        whole, shards = (next(j for j, s in sharded.items() if s is form) for form in (False, True))
        raise UserError(f"{by_part[whole][0]}: model_part-{whole} is one consolidated file but model_part-{shards} is "
                        f"raw shards ({summarize_paths(by_part[shards])}); give every part in one form: narrow {flag}, "
                        "or reshard that part with reshard_fsdp first")
    most = max(len(paths) for paths in by_part.values())
    for j, paths in sorted(by_part.items()):
        if len(paths) < most:
            lack = min(set(range(most)) - {_last_int(_SHARD_RE, p) for p in paths})
            raise UserError(f"{shard_file_name(checkpoint_prefix(paths[0]), j, lack)} is missing: model_part-{j} has "
                            f"{len(paths)} shard files, other parts {most}; every part has as many shards")
    return [_order_shards(by_part[j], flag) for j in sorted(by_part)]


def glob_files(pattern: str) -> list[str]:
    """The files `pattern` matches, natural-sorted; '~' expanded as the shell would, also when quoted. Brackets that
    match nothing as a character class are part of the names (a folder named `run[1]`)."""
    for candidate in pattern_forms(os.path.expanduser(pattern)):
        matches = glob.glob(candidate)
        check_no_broken_links(matches)
        paths = sorted((p for p in matches if os.path.isfile(p)), key=natural_sort_key)
        if paths:
            return paths
    return []


def pattern_forms(pattern: str) -> tuple[str, ...]:
    """The ways to read a glob, in order: as it is, and where it has '[' with brackets as plain characters."""
    return (pattern, pattern.replace("[", "[[]")) if "[" in pattern else (pattern,)


def check_no_broken_links(paths: Sequence[str]) -> None:
    """Refuse a symbolic link whose file is gone (a shard skipped for it would be called missing, or the set wrong)."""
    for path in sorted(paths, key=natural_sort_key):
        if os.path.islink(path) and not os.path.exists(path):
            raise UserError(f"{path} is a broken symbolic link (to {os.readlink(path)}, which does not exist); "
                            "restore that file, or remove the link")


def is_glob(path: str) -> bool:
    """Whether `path` is a pattern of files rather than a name: no such file, and `*`, `?` or a `[...]` class that
    matches files (a stem such as `run[1]/checkpoint_last.pt` is a name)."""
    path = os.path.expanduser(path)
    return not os.path.isfile(path) and (re.search(r"[*?]", path) is not None or "[" in path and bool(glob.glob(path)))


def _glob_files(pattern: str, flag: str, *, every_part: bool) -> list[str]:
    """The files, or an error with the globs to pass for a folder or a save's name: of one part's shards, or with
    `every_part` (a tool taking all model parts) of every part's."""
    paths = glob_files(pattern)
    if not paths:
        hint = folder_hint(pattern, globs=True, every_part=every_part) or _stem_hint(pattern, every_part)
        raise UserError(f"{flag} {pattern!r} matches no files{hint}")
    return paths


def _stem_hint(pattern: str, every_part: bool) -> str:
    """For the name of a save (`DIR/checkpoint_last.pt`, as training and inference take it): its shard files' glob."""
    if is_glob(pattern) or not glob_files(shard_glob(pattern, "*")):
        return ""
    example = shard_glob(pattern, "*" if every_part else 0)
    return f"; it names a save, not its files: pass the shard files, e.g. {example!r}"


def folder_hint(path: str | os.PathLike, *, globs: bool = False, every_part: bool = False) -> str:
    """For a folder given where a checkpoint was expected: '; it is a folder: ...' naming the checkpoints in it as
    stems (`DIR/checkpoint_last.pt` for its shards) or, with `globs`, as globs of one part's shards (`every_part`:
    of all parts' shards); else ''."""
    folder = os.path.expanduser(str(path))
    if not os.path.isdir(folder):
        return ""
    found = set()
    for file in glob.glob(os.path.join(glob.escape(folder), "*.pt")):
        stem, part = checkpoint_prefix(file) + ".pt", model_part_number(file)
        part = "*" if every_part and part is not None else part
        found.add(repr(shard_glob(stem, part)) if globs and stem != file and part is not None else stem)
    if not found:
        return "; it is a folder without .pt files"
    return f"; it is a folder: name a checkpoint in it, e.g. {summarize_paths(sorted(found, key=natural_sort_key))}"


def _order_shards(paths: Sequence[str], flag: str) -> list[str]:
    """Shard files of one part in index order (indices exactly 0..N-1); one file as it is."""
    seen: dict[int, str] = {}
    for path, index in zip(paths, _shard_indices(paths) if len(paths) > 1 else [0]):
        if index in seen:
            raise UserError(f"shard index {index} appears twice: {seen[index]} and {path}; {flag} matches two "
                            "checkpoints (or a copy): make it match one")
        seen[index] = path
    missing = sorted(set(range(len(paths))) - set(seen))
    if missing:
        raise UserError(f"shard{missing[0]} is missing: found {len(paths)} shard files ({summarize_paths(paths)}) "
                        f"but shard indices must be exactly 0..{len(paths) - 1}; check {flag}")
    return [seen[i] for i in range(len(paths))]


def _shard_indices(paths: Sequence[str]) -> list[int]:
    """`shardK` in every name, or the one number that differs between the names."""
    indices = [_last_int(_SHARD_RE, p) for p in paths]
    if None not in indices:
        return indices
    if len({re.sub(r"\d+", "#", p) for p in paths}) > 1:
        raise UserError(f"{paths[indices.index(None)]}: no shard index ('shardK') in its name like the other "
                        "inputs; cannot order the inputs")
    numbers = zip(*([int(n) for n in re.findall(r"\d+", p)] for p in paths))
    varying = {column for column in numbers if len(set(column)) > 1}
    if len(varying) != 1:
        raise UserError(f"{summarize_paths(paths)}: cannot tell which number in the names is the shard index; "
                        "name the files '...shard{i}.pt'")
    return list(varying.pop())


def file_in_the_way(path: str | os.PathLike) -> str | None:
    """The nearest existing parent of `path` if it is not a folder (a file: writing `path` fails), else None."""
    parent = os.path.dirname(os.path.normpath(os.fspath(path)))
    while parent and not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent if parent and os.path.lexists(parent) and not os.path.isdir(parent) else None


def model_part_number(path: str) -> int | None:
    """J of a file named '...model_part-J...', else None."""
    return _last_int(_PART_RE, path)


def _last_int(pattern: re.Pattern, path: str) -> int | None:
    found = pattern.findall(os.path.basename(path))
    return int(found[-1]) if found else None


def summarize_paths(paths: Sequence[str], limit: int = 3) -> str:
    """The first `limit` paths for a message: `a.pt, b.pt, c.pt, ... (8 files)`."""
    return ", ".join(paths[:limit]) + (f", ... ({len(paths)} files)" if len(paths) > limit else "")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` through `atomic_output`; a write error such as ENOSPC is raised as that OSError, and Ctrl-C
    or SIGTERM during a write as itself (torch reports either as an opaque RuntimeError)."""
    import torch

    with atomic_output(path) as f:
        writer = _WriteErrorRecorder(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:  # torch wraps it as "unexpected pos ..."
                raise writer.error from None
            raise


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, replace: bool = True, clean: bool = True) -> Iterator[BinaryIO]:
    """Write `path` through a temp file: yields the temp file, open for reading and writing.

    The temp file is `.NAME.<pid>.<random>.tmp` (never matched by a `*.pt` glob); ones left by killed writers are
    removed first (unless not `clean`: a caller writing many files removes them for all at once). On success it
    is fsync-ed and renamed over `path` (without `replace`, only where no file is: FileExistsError if one
    appeared), then the folder is fsync-ed; on any error it is removed: `path` holds the whole file or is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # Path("name.pt").parent is Path(".")
    if clean:
        remove_stale_temp_files(path)
    tmp = _temp_name(path)
    with _renamed_into_place(tmp, path, replace):
        with open(tmp, "x+b") as f:  # a new file, permissions as `open` gives them
            yield f
            f.flush()
            os.fsync(f.fileno())


def atomic_link(src: str | os.PathLike, path: str | os.PathLike) -> None:
    """Replace `path` by the file `src` atomically: a hard link to it (no data written, so a full disk cannot stop
    it), renamed over `path`; a copy through `atomic_output` where the file system has no hard links."""
    path = Path(path)
    remove_stale_temp_files(path)
    tmp = _temp_name(path)
    try:
        os.link(src, tmp)
    except OSError:  # no hard links here (EPERM, EXDEV, ENOSYS, ...): a copy, which says what else is wrong
        with open(src, "rb") as f, atomic_output(path) as out:
            shutil.copyfileobj(f, out, 16 << 20)
        return
    with _renamed_into_place(tmp, path):
        pass


def _temp_name(path: Path) -> Path:
    """A new temp file name beside `path`: `.NAME.<pid>.<random>.tmp`."""
    return path.parent / f".{_temp_stem(path.name)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


@contextlib.contextmanager
def _renamed_into_place(tmp: Path, path: Path, replace: bool = True) -> Iterator[None]:
    """After the block, `tmp` renamed to `path` (see `_rename`) and the folder fsync-ed; on any error `tmp` removed."""
    try:
        yield
        _rename(tmp, path, replace)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a crash."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _rename(tmp: Path, path: Path, replace: bool) -> None:
    """`tmp` renamed to `path`; without `replace` never over a file (a hard link, then the temp name removed; where
    the file system has no hard links, a check just before the rename)."""
    if replace:
        return os.replace(tmp, path)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        return os.replace(tmp, path)
    os.unlink(tmp)


class _WriteErrorRecorder:
    """File wrapper for torch.save that remembers what a write raised (an OSError, or Ctrl-C/SIGTERM)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.flush = f, f.flush
        self.error: BaseException | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except BaseException as e:
            self.error = e
            raise


def remove_stale_temp_files(paths: str | os.PathLike | Sequence[str | os.PathLike], *, ours: bool = False) -> None:
    """Remove the temp files of `paths` (one, or many: each folder is listed once) whose writer died:
    `.NAME.<pid>.<random>.tmp` whose pid no longer runs on this host (with `ours`, also this process's: its writers
    are done), and `.NAME.<random>.tmp` of older versions, which carry no pid."""
    by_folder: dict[Path, set[str]] = {}
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        by_folder.setdefault(Path(path).parent, set()).add(_temp_stem(Path(path).name))
    for folder, stems in by_folder.items():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            match = _TEMP_RE.fullmatch(name)
            stem, _, pid = match.group(1).rpartition(".") if match else ("", "", "")
            if not match or match.group(1) not in stems and (stem not in stems or not re.fullmatch(r"\d+", pid)
                                                             or _pid_alive(int(pid), ours)):
                continue  # not a temp file of `paths` (or of one without a pid), or its writer runs
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)
                logger.warning("removed %s, a temporary file left by a killed run", folder / name)


def remove_stale_temp_files_in(folder: str | os.PathLike) -> None:
    """Every temp file in `folder` whose writer died (see `remove_stale_temp_files`)."""
    with contextlib.suppress(OSError):
        found = [m.group(1).rpartition(".")[0] for m in map(_TEMP_RE.fullmatch, os.listdir(folder)) if m]
        remove_stale_temp_files([Path(folder) / stem for stem in found if stem])


def _temp_stem(name: str) -> str:
    """`name` as its temp files begin (`.STEM.<pid>.<random>.tmp`, 22 bytes more): cut, with a hash of the whole
    name, where those would pass the 255-byte limit of a file name."""
    if len(name.encode()) <= 255 - 22:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return name.encode()[:200].decode(errors="ignore") + "~" + digest


def _pid_alive(pid: int, ours: bool = False) -> bool:
    if ours and pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError as e:  # EPERM: it exists, owned by someone else
        return not isinstance(e, ProcessLookupError)
    return True


def load_checkpoint(path: str | os.PathLike, *, mmap: bool = False, trust: bool = False) -> dict:
    """Load one checkpoint file with torch, unpickling only tensors, builtins, `torch.Size` and `argparse.Namespace`
    unless `trust` (any pickle: only for trusted files). `mmap` maps tensor storages from disk (legacy-format files
    are read). The pickle is checked against its zip CRC32 first, tensor data not (see `check_checkpoint_crc`)."""
    import torch

    path = str(path)
    mmap = mmap and check_checkpoint_crc(path, tensors=False) is not None
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS), warnings.catch_warnings():  # only weights_only reads them
            warnings.filterwarnings("ignore", "Detected pickle protocol")  # where it matters, the error says so
            obj = torch.load(path, map_location="cpu", mmap=mmap, weights_only=not trust)
    except FileNotFoundError:
        raise CheckpointLoadError(f"{path}: no such file") from None
    except Exception as e:  # unsafe type, truncated, corrupt, not a torch file
        raise _load_error(path, e) from None
    if not isinstance(obj, dict):
        raise CheckpointLoadError(f"{path}: expected a dict checkpoint, found {type(obj).__name__}")
    return obj


def _pickle_protocol(path: str) -> int:
    """The protocol of a checkpoint's pickle (a zip's data.pkl, else the file's first); 0 where there is none."""
    try:
        try:
            record = zip_records(path).get("data.pkl")
            head = bytes(read_at(path, record.offset, 2)) if record else b""
        except NeedsTorch:  # not a zip: a legacy file starts with a pickle
            head = bytes(read_at(path, 0, 2))
    except (OSError, CheckpointLoadError):
        return 0
    return head[1] if len(head) == 2 and head[0] == 0x80 else 0


def _load_error(path: str, e: BaseException) -> CheckpointLoadError:
    text = str(e)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)  # only weights_only=True refuses types
    if found:
        return CheckpointLoadError(f"{path}: refusing to unpickle a type outside the checkpoint format (it "
                                   f"contains {found.group(1)}); if you trust this file, pass --trust-checkpoint")
    missing = re.search(r"No module named '([\w.]+)'", text)
    if isinstance(e, (ModuleNotFoundError, AttributeError)) and missing:
        return CheckpointLoadError(f"{path}: it holds objects of module {missing.group(1)}, which is not installed "
                                   f"here ({type(e).__name__}); install it, or use a tool that carries such objects "
                                   "without loading them")
    missing = re.search(r"Can't get attribute '([\w.]+)' on <module '([\w.]+)'", text)
    if isinstance(e, AttributeError) and missing:
        return CheckpointLoadError(f"{path}: it holds objects of class {missing.group(2)}.{missing.group(1)}, which "
                                   "is not defined here (AttributeError); import the code that defines it, or use a "
                                   "tool that carries such objects without loading them")
    opcode = re.search(r"WeightsUnpickler error:\s*Unsupported operand (\d+)", text)
    if opcode and _pickle_protocol(path) >= 4:
        return CheckpointLoadError(f"{path}: torch's safe loader cannot read its pickle (opcode {opcode.group(1)}: "
                                   "saved with pickle protocol 4 or later?); if you trust this file, pass "
                                   "--trust-checkpoint, or save it again with torch.save's default protocol")
    text = re.sub(r"^[\s\S]*?WeightsUnpickler error:", "unpickling failed:", text).strip()
    text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)
    detail = type(e).__name__ + (f": {text.splitlines()[0][:100]}" if text else "")
    return CheckpointLoadError(f"{path}: cannot read checkpoint ({detail}); the file is truncated, corrupt or not "
                               "a torch checkpoint")


def check_checkpoint_crc(path: str | os.PathLike, *, tensors: bool = True) -> tuple[int, int] | None:
    """Check a torch zip checkpoint's records against the CRC32s in its zip directory (torch.load never does).

    With `tensors` every record is read (the whole file), else only the small ones (pickle, version, byteorder);
    records without a CRC (0, as `torch.serialization.set_crc32_options(False)` and this project's writer without
    `crc32` leave) are not. Returns (bytes checked, bytes of records without a CRC), or None for a file that is not
    a zip (torch's legacy format or garbage: torch.load decides).
    """
    path = str(path)
    try:
        records = zip_records(path)
    except NeedsTorch:
        return None
    wanted = [(name, r) for name, r in records.items() if tensors or not name.startswith("data/")]
    for name, record in wanted:
        if record.crc:
            check_record(path, name, record)
    return sum(r.size for _, r in wanted if r.crc), sum(r.size for _, r in wanted if not r.crc)
