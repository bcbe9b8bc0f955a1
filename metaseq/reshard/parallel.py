"""Write the output files of a reshard run, in this process or in a pool of worker processes.

    jobs = list_jobs(plans)                   # one per output file, over every model part
    write_jobs(plans, jobs, num_workers=4)    # atomic files; all or nothing

Each process holds one output shard at a time: its tensors are allocated compactly,
filled from the mmap-loaded inputs it needs, saved, and their memory is reused for
the next output (same shapes within a part, and fresh pages are slow to fault in).
A worker pool (forkserver, else spawn) runs K such writers, so peak memory is about
K x (largest output shard + `PROCESS_BYTES`); the default K keeps the whole run
within the single-process bound (see `default_num_workers`). Plans read without
torch (`ReshardPlan.direct`, the usual case) are written by `metaseq.reshard.direct`
instead: the kernel copies the bytes and holds no GIL meanwhile, so K writers are K
threads of this process, and memory stays the interpreter's. A failure anywhere
removes every output of the call before the error is raised.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from metaseq.file_io import atomic_torch_save, load_checkpoint, remove_stale_temp_files
from metaseq.reshard.build import build_output_shard, plan_targets
from metaseq.reshard.direct import write_direct_output
from metaseq.reshard.progress import JobMeter, Progress, Send
from metaseq.reshard.schema import ReshardError
from metaseq.torchzip import CHUNK_BYTES

if TYPE_CHECKING:
    import torch

    from metaseq.reshard.driver import ReshardPlan

# torch (1.5 s or more to import) is imported by the functions that need it: plans read
# without torch (`ReshardPlan.direct`) are written without it.

__all__ = [
    "OutputJob",
    "OutputWriter",
    "available_cpus",
    "default_num_workers",
    "estimated_peak",
    "held_bytes",
    "list_jobs",
    "memory_bound",
    "remove_outputs",
    "save_output",
    "streams",
    "threaded",
    "write_jobs",
]

MIB = 1 << 20
SLACK_BYTES = 256 * MIB  # issue 6: allowed on top of the output (and largest flat parameter)
PROCESS_BYTES = 160 * MIB  # anonymous memory of a Python process once torch is imported (measured 146 MiB)
POLL_SECONDS = 0.2
STREAM_MIN_BYTES = 64 * MIB  # smaller outputs are built in memory (streaming saves and re-reads each file)
BYTES_PER_WORKER = 2 << 30  # starting the pool (forkserver importing torch) takes ~2 s: worth it for this much


@dataclass(frozen=True)
class OutputJob:
    """One output file: output shard `rank` of `plans[plan]`."""

    index: int  # position in the run's job list; under torchrun, rank index % world writes it
    plan: int
    rank: int
    path: str
    nbytes: int  # bytes of its tensors


def list_jobs(plans: Sequence[ReshardPlan]) -> list[OutputJob]:
    """Every output of every plan, part by part, in shard order."""
    jobs: list[OutputJob] = []
    for p, plan in enumerate(plans):
        # Every output shard of a plan has the same tensor shapes (FSDP pads all ranks alike).
        nbytes = sum(t.nbytes for t in plan_targets(plan.source, plan.options, 0))
        for rank, path in enumerate(plan.outputs):
            jobs.append(OutputJob(len(jobs), p, rank, path, nbytes))
    return jobs


def memory_bound(plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob]) -> int:
    """Issue 6's peak anonymous memory bound for one process writing `jobs`.

    Flat outputs: largest output shard + largest flat parameter + 256 MiB;
    unflattened: the output + 256 MiB.
    """
    largest_flat = 0
    for plan in plans:
        if not plan.options.unflatten:
            model = plan.source.model
            for fp, dtype in zip(model.flat_params, model.dtypes):
                largest_flat = max(largest_flat, fp.numel * dtype.itemsize)
    return max((j.nbytes for j in jobs), default=0) + largest_flat + SLACK_BYTES


def available_cpus(processes_per_node: int = 1) -> int:
    """CPUs this process may use (its affinity mask, e.g. a Slurm allocation), shared by `processes_per_node`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, processes_per_node))


def default_num_workers(
    plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], *, cpus: int, checksums: bool = False
) -> int:
    """Most workers (at most `cpus` and one per job) whose estimated peak stays within `memory_bound`.

    K > 1 workers cost this process, the forkserver and K workers, each `PROCESS_BYTES`,
    plus what K writers hold at once (`held_bytes`); one worker is this process alone.
    Each worker must also have `BYTES_PER_WORKER` to write, or starting it costs more
    than it saves. Bigger K is the user's choice (`--num-workers`), at K x the memory.
    """
    if threaded(plans):  # threads copying in the kernel: no extra memory
        return max(1, min(cpus, len(jobs)))
    bound = memory_bound(plans, jobs)
    largest = held_bytes(plans, jobs, checksums)
    limit = min(cpus, len(jobs), max(1, sum(j.nbytes for j in jobs) // BYTES_PER_WORKER))
    k = 1
    while k < limit and estimated_peak(k + 1, largest) <= bound:
        k += 1
    return k


def estimated_peak(num_workers: int, largest_held: int) -> int:
    """Peak anonymous memory of the whole process tree with `num_workers` writers (see `held_bytes`)."""
    if num_workers <= 1:
        return PROCESS_BYTES + largest_held
    return 2 * PROCESS_BYTES + num_workers * (PROCESS_BYTES + largest_held)


def threaded(plans: Sequence[ReshardPlan]) -> bool:
    """Whether the writers are threads of this process (every plan direct), not worker processes."""
    return all(plan.direct for plan in plans)


def streams(job: OutputJob, checksums: bool) -> bool:
    """Whether `job` is written by `stream_output_shard` (big, and no CRC32s wanted)."""
    return not checksums and job.nbytes >= STREAM_MIN_BYTES


def held_bytes(plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], checksums: bool = False) -> int:
    """Most anonymous memory one writer holds for a job: the output built in memory, or a cast buffer.

    Trusted inputs may carry tensors inside arbitrary objects, which cannot be streamed:
    their outputs count as built in memory.
    """
    return max((CHUNK_BYTES if streams(j, checksums) and not plans[j.plan].trust_checkpoint else j.nbytes
                for j in jobs), default=0)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Copies are memory-bound: torch's intra-op threads only add spinning (2-5x slower on busy CPUs)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_output(shard: dict[str, Any], path: str, *, meter: JobMeter | None = None, checksums: bool = False) -> int:
    """Save atomically (temp file, fsync, rename); returns the file size.

    Without `checksums` the zip CRC32 fields are left 0: torch never checks them, and
    computing them made saving 3-5x slower than the rest of a reshard.
    """
    from metaseq.reshard.stream import zip_crc32  # imports torch

    try:
        with zip_crc32(checksums):
            atomic_torch_save(shard, path, on_write=meter.written if meter is not None else None)
        return os.path.getsize(path)
    except OSError as e:
        raise ReshardError(f"{path}: cannot write ({e.strerror or e})") from e


class _InputCache:
    """Inputs for `build_output_shard`: rank 0 loaded (its other keys are carried), others mapped.

    An input the planner located (`metaseq.reshard.locate`) is only mapped, not
    unpickled again. Keeps the current part's rank 0 and the last other input:
    consecutive outputs usually start in the input where the previous one stopped.
    Kept inputs cost address space, not memory.
    """

    def __init__(self) -> None:
        self.kept: dict[str, dict[str, Any]] = {}

    def fetch(self, plan: ReshardPlan, rank: int) -> dict[str, Any]:
        path = plan.inputs[rank]
        if path not in self.kept:
            located = plan.located[rank] if rank and rank < len(plan.located) else None
            if located is not None:
                from metaseq.reshard.locate import map_located  # imports torch

                shard = map_located(located)
            else:
                shard = load_checkpoint(path, mmap=True, trust=plan.trust_checkpoint)
            self.kept = {p: v for p, v in self.kept.items() if p == plan.inputs[0]}
            self.kept[path] = shard
        return self.kept[path]


class _Buffers:
    """`allocate` for `build_output_shard` that hands out the previous output's tensors again.

    Every output shard of one part has the same tensor shapes, so from the second
    output on no fresh memory is touched. Holds at most one output's tensors.
    """

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self.used: list[torch.Tensor] = []

    def allocate(self, shape: torch.Size, *, dtype: torch.dtype) -> torch.Tensor:
        import torch

        stack = self.free.get((tuple(shape), dtype))
        tensor = stack.pop() if stack else torch.empty(shape, dtype=dtype)
        self.used.append(tensor)
        return tensor

    def recycle(self) -> None:
        """Call once the output built from these tensors is saved and dropped."""
        self.free = defaultdict(list)
        for tensor in self.used:
            self.free[(tuple(tensor.shape), tensor.dtype)].append(tensor)
        self.used = []


class OutputWriter:
    """Builds and saves jobs one at a time, reusing inputs and buffers between them."""

    def __init__(self, plans: Sequence[ReshardPlan], *, checksums: bool = False) -> None:
        self.plans, self.checksums = plans, checksums
        self.inputs = _InputCache()
        self.buffers = _Buffers()
        self.last_plan: int | None = None

    def write(self, job: OutputJob, send: Send | None = None) -> int:
        """Write `job.path` (streamed when big, else built in memory); returns its size in bytes."""
        plan = self.plans[job.plan]
        meter = JobMeter(job.index, job.nbytes, send)

        def fetch(rank: int) -> dict[str, Any]:
            return self.inputs.fetch(plan, rank)

        if plan.direct:
            return write_direct_output(plan.source, plan.options, job.rank, plan.direct, job.path,
                                       report=meter.streamed)
        if streams(job, self.checksums):
            from metaseq.reshard.stream import stream_output_shard  # imports torch

            try:
                size = stream_output_shard(plan.source, plan.options, job.rank, fetch, job.path,
                                           trust=plan.trust_checkpoint, report=meter.streamed)
            except OSError as e:
                raise ReshardError(f"{job.path}: cannot write ({e.strerror or e})") from e
            if size is not None:
                return size
        if job.plan != self.last_plan:  # other shapes: drop the previous part's buffers first
            self.buffers, self.last_plan = _Buffers(), job.plan
        shard = build_output_shard(plan.source, plan.options, job.rank, fetch,
                                   allocate=self.buffers.allocate, on_copied=meter.copied)
        size = save_output(shard, job.path, meter=meter, checksums=self.checksums)
        del shard
        self.buffers.recycle()
        return size


def write_jobs(
    plans: Sequence[ReshardPlan],
    jobs: Sequence[OutputJob],
    *,
    num_workers: int = 1,
    progress: Progress | None = None,
    checksums: bool = False,
) -> list[str]:
    """Write every job's file, with `num_workers` processes; returns the paths written.

    On any error (or interrupt) every file this call wrote is removed, then the error
    is raised: a worker's error as itself (ReshardError, CheckpointLoadError, ...).
    """
    progress = progress or Progress(sum(j.nbytes for j in jobs), len(jobs))
    paths = [j.path for j in jobs]
    before = _file_ids(paths)
    written: list[str] = []
    try:
        if threaded(plans):
            _write_in_threads(plans, jobs, max(1, min(num_workers, len(jobs))), progress, written)
        elif num_workers <= 1 or len(jobs) <= 1:
            with _one_thread():
                _write_here(plans, jobs, progress, written, checksums)
        else:
            _write_in_pool(plans, jobs, min(num_workers, len(jobs)), progress, written, checksums)
    except BaseException:
        # Also outputs renamed into place just before the error, not yet in `written`.
        now = _file_ids(paths)
        remove_outputs([p for p in paths if now[p] is not None and now[p] != before[p]], paths)
        raise
    finally:
        progress.close()
    return written


def _file_ids(paths: Sequence[str]) -> dict[str, tuple[int, int] | None]:
    """(device, inode) per existing path: a file this run renamed into place has a new one."""
    ids: dict[str, tuple[int, int] | None] = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            ids[path] = None
        else:
            ids[path] = (stat.st_dev, stat.st_ino)
    return ids


def remove_outputs(written: Sequence[str], planned: Sequence[str] = ()) -> None:
    """Remove the files written, and temp files that killed writers of `planned` paths left."""
    for path in written:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for path in planned:
        with contextlib.suppress(OSError):
            remove_stale_temp_files(path)


def _write_here(
    plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], progress: Progress, written: list[str], checksums: bool
) -> None:
    writer = OutputWriter(plans, checksums=checksums)
    for job in jobs:
        size = writer.write(job, progress.advance)
        written.append(job.path)
        progress.finish(job.index, job.nbytes, job.path, size)


def _write_in_threads(
    plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], num_workers: int, progress: Progress, written: list[str]
) -> None:
    """Direct plans: `num_workers` threads (the copies run in the kernel, without the GIL)."""
    lock = threading.Lock()

    def send(index: int, nbytes: int) -> None:
        with lock:
            progress.advance(index, nbytes)

    def run(job: OutputJob) -> None:
        size = OutputWriter(plans).write(job, send)
        with lock:
            written.append(job.path)
            progress.finish(job.index, job.nbytes, job.path, size)

    if num_workers == 1:
        for job in jobs:
            run(job)
        return
    with ThreadPoolExecutor(num_workers, thread_name_prefix="reshard-writer") as pool:
        futures = [pool.submit(run, job) for job in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                if future.done() and future.exception() is not None:
                    raise future.exception()
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)  # the running copies finish; their files are then removed with the rest
            raise


# Worker side: one OutputWriter per worker process, made by the pool's initializer.
_worker: dict[str, Any] = {}


def _init_worker(plans: Sequence[ReshardPlan], queue: Any, checksums: bool) -> None:
    import torch

    torch.set_num_threads(1)
    _worker["writer"] = OutputWriter(plans, checksums=checksums)
    _worker["queue"] = queue


def _write_job(job: OutputJob) -> int:
    queue = _worker["queue"]
    return _worker["writer"].write(job, lambda index, nbytes: queue.put((index, nbytes)))


def _pool_context() -> multiprocessing.context.BaseContext:
    """forkserver (torch imported once, workers forked from it), or spawn where there is none."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "metaseq.reshard.stream"])  # torch imported once
        return ctx
    return multiprocessing.get_context("spawn")


def _write_in_pool(
    plans: Sequence[ReshardPlan],
    jobs: Sequence[OutputJob],
    num_workers: int,
    progress: Progress,
    written: list[str],
    checksums: bool,
) -> None:
    ctx = _pool_context()
    queue = ctx.SimpleQueue()  # progress; put() is synchronous, so it precedes the job's result
    initargs = (tuple(plans), queue, checksums)
    with ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_worker, initargs=initargs) as pool:
        futures = {pool.submit(_write_job, job): job for job in jobs}
        try:
            _collect(futures, queue, progress, written)
        except BaseException:
            for future in futures:
                future.cancel()
            _collect(futures, queue, progress, written, failed=True)  # wait for the running ones
            raise


def _collect(
    futures: dict[Future, OutputJob], queue: Any, progress: Progress, written: list[str], *, failed: bool = False
) -> None:
    """Wait for the futures, feeding progress; raise the first error unless the run already `failed`."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
        while not queue.empty():  # drain, or workers block on a full pipe
            progress.advance(*queue.get())
        for future in done:
            job = futures[future]
            if future.cancelled() or job.path in written:
                continue
            if future.exception() is None:
                written.append(job.path)
                progress.finish(job.index, job.nbytes, job.path, future.result())
            elif not failed:
                raise _worker_error(future.exception(), job)


def _worker_error(error: BaseException, job: OutputJob) -> BaseException:
    if isinstance(error, BrokenProcessPool):
        return ReshardError(
            f"a worker process died while writing {job.path} (killed, e.g. out of memory?); "
            "rerun with fewer --num-workers"
        )
    return error
