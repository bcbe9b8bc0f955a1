"""The one writer: every planned output file, written atomically by copying its runs' bytes.

    written = write_outputs(jobs, num_workers=4, progress=progress)   # all or nothing

Each output's object is assembled from its plan (`assemble_output`) and written with
`metaseq.torchzip.write_checkpoint`: tensor bytes go file to file in the kernel, cast
chunk by chunk where `--output-dtype` asks. The kernel holds no GIL while copying, so
K outputs are written by K threads of this process, and memory stays the interpreter's
plus the pickles. A failure anywhere removes every output of the call before the error
is raised.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple, Sequence

from metaseq.errors import ReshardError
from metaseq.file_io import atomic_output, remove_stale_temp_files
from metaseq.reshard.plan import InputFile, OutFile, Plan, assemble_output
from metaseq.reshard.progress import Progress
from metaseq.torchzip import signals_held, write_checkpoint

__all__ = ["Job", "available_cpus", "list_jobs", "missing_folders", "remove_outputs", "write_outputs"]


class Job(NamedTuple):
    """One output file of a run."""

    plan: Plan
    out: OutFile


def list_jobs(plans: Sequence[Plan]) -> list[Job]:
    """Every output of every plan, part by part, in shard order; under torchrun, rank r writes jobs r, r + world, ..."""
    return [Job(plan, out) for plan in plans for out in plan.outputs]


def available_cpus(processes_per_node: int = 1) -> int:
    """CPUs this process may use (its affinity mask, e.g. a Slurm allocation), shared by `processes_per_node`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, processes_per_node))


def write_outputs(jobs: Sequence[Job], *, num_workers: int = 1, progress: Progress | None = None,
                  crc32: bool = False) -> list[str]:
    """Write every job's file with `num_workers` threads; returns the paths written.

    On any error (or interrupt) every file this call wrote is removed, then the error is raised.
    `crc32`: store zip CRC32s of the tensor records too (`--verify`).
    """
    progress = progress or Progress(sum(j.out.nbytes for j in jobs), len(jobs))
    paths = [j.out.path for j in jobs]
    remove_stale_temp_files(paths)  # what killed writers left, each folder listed once
    before, foreign = _file_ids(paths), set()  # foreign: outputs another process wrote meanwhile (left alone)
    lock, stopped = threading.Lock(), threading.Event()  # stopped: another job failed, or an interrupt

    def run(index: int, job: Job) -> None:  # `index`: the job's key in `progress`
        def report(nbytes: int) -> None:
            if stopped.is_set():  # a chunk at most after the stop, not the rest of the file (a SIGTERM's grace)
                raise _Stopped
            with lock:
                progress.advance(index, nbytes)

        try:
            size = _write_one(job, crc32, report)
        except FileExistsError as e:
            foreign.add(job.out.path)
            raise ReshardError(f"{job.out.path} appeared while resharding (another process wrote it?); it is left "
                               "as it is: remove it and rerun, or pass --overwrite") from e
        with lock:
            progress.finish(index, job.out.nbytes, job.out.path, size)

    try:
        if num_workers <= 1 or len(jobs) <= 1:
            for index, job in enumerate(jobs):
                run(index, job)
        else:
            with ThreadPoolExecutor(min(num_workers, len(jobs)), thread_name_prefix="reshard-writer") as pool:
                try:
                    with signals_held():  # a thread started, but not yet recorded for shutdown, would be left running
                        futures = [pool.submit(run, index, job) for index, job in enumerate(jobs)]
                    for future in as_completed(futures):
                        future.result()
                except BaseException:
                    with signals_held():  # another Ctrl-C would cut the wait short and leave writers running
                        stopped.set()
                        pool.shutdown(cancel_futures=True)  # the running copies stop; their temp files are removed
                    raise
    except BaseException:
        # Every output this call renamed into place (a file it did not find there), also one renamed just before
        # the error; a path left as it was keeps its old file.
        with signals_held():
            now = _file_ids(paths)
            remove_outputs([p for p in paths if p in now and now[p] != before.get(p) and p not in foreign], paths)
        raise
    finally:
        progress.close()
    return paths


class _Stopped(Exception):
    """Raised in a writer thread to stop its copy: the run is failing."""


def _write_one(job: Job, crc32: bool, report: object) -> int:
    """Write one output atomically; returns its size. The inputs must be as planned before and after the copy (else
    the temp file is removed, never renamed into place)."""
    first = (job.out.source or job.plan.source).model.first  # whose other values (tensors too) are carried
    read = [job.plan.inputs[i] for i in sorted({first, *(run.input for t in job.out.tensors for run in t.runs)})]
    _check_unchanged(read)
    obj = assemble_output(job.plan, job.out)
    try:
        with atomic_output(job.out.path, replace=job.plan.options.overwrite, clean=False) as f:  # cleaned once
            size = write_checkpoint(f.fileno(), obj, crc32=crc32, report=report)
            _check_unchanged(read)
            return size
    except OverflowError as e:  # from a cast: torch would have written inf
        wider = "use --output-dtype bf16 (about float32's range) or " if job.plan.options.output_dtype == "fp16" else ""
        raise ReshardError(f"{job.out.path}: --output-dtype: {e}; {wider}keep the dtype") from None
    except FileExistsError:
        raise
    except OSError as e:
        raise ReshardError(f"{job.out.path}: cannot write ({e.strerror or e})") from e


def _check_unchanged(inputs: Sequence[InputFile]) -> None:
    """The inputs an output reads must be as planned (what else it holds was read while planning)."""
    for item in [i for i in inputs if i.size >= 0]:  # -1: given in memory
        stat = os.stat(item.path)
        if (stat.st_size, stat.st_mtime_ns) != (item.size, item.mtime_ns):
            raise ReshardError(f"{item.path} changed while resharding (size or time differ from planning); rerun")


def _file_ids(paths: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(device, inode) per existing path: a file this run renamed into place has a new one."""
    ids = {}
    for path in paths:
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            ids[path] = (stat.st_dev, stat.st_ino)
    return ids


def missing_folders(paths: Sequence[str]) -> list[str]:
    """The folders writing `paths` would make (they do not exist yet), the deepest first."""
    folders = {f for p in paths for f in Path(p).absolute().parents if not f.exists()}
    return [str(f) for f in sorted(folders, key=lambda f: len(f.parts), reverse=True)]


def remove_outputs(written: Sequence[str], planned: Sequence[str] = (), folders: Sequence[str] = ()) -> None:
    """Remove the files written, temp files of `planned` paths that killed writers or this process left (a second
    signal can cut a temp file's own clean-up short), then `folders` left empty (`missing_folders` before the run:
    one that holds files, e.g. another rank's, stays). Only once this process's writers are done."""
    for path in written:
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        remove_stale_temp_files(planned, ours=True)
    for folder in folders:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
