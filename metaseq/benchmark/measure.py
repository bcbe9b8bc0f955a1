"""Time a command and sample the memory of its whole process tree.

Memory is read from `/proc/<pid>/status` every `interval` seconds and summed
over the process and all its descendants (the reshard tool may use workers):
`VmRSS` (everything resident) and `RssAnon` (anonymous pages only: heap and
private copies, not clean pages of mmap-ed or cached files, which the kernel
can drop at any time). Peaks between two samples can be missed; at 20 ms a
tensor that lives for less than that is the only thing that slips through.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "Measurement",
    "best_of",
    "drop_page_cache",
    "process_tree",
    "read_rss",
    "run_measured",
]

SAMPLE_INTERVAL_S = 0.02
STDERR_TAIL_CHARS = 4000


@dataclass(frozen=True)
class Measurement:
    seconds: float  # wall time from start to exit
    peak_rss: int  # bytes, max over samples of the tree's summed VmRSS
    peak_anon: int  # bytes, max over samples of the tree's summed RssAnon
    returncode: int
    stderr_tail: str
    runs_seconds: tuple[float, ...] = ()  # every repetition's wall time, when combined

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_rss(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of one process in bytes; (0, 0) once it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return _kib(fields.get("VmRSS")), _kib(fields.get("RssAnon"))


def _kib(value: str | None) -> int:
    return int(value.split()[0]) * 1024 if value else 0  # "1234 kB"


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from the parent ids in `/proc/*/stat`."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may contain spaces and ")"
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


class _Sampler(threading.Thread):
    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_anon = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval)

    def sample(self) -> None:
        rss = anon = 0
        for p in process_tree(self.pid):
            r, a = read_rss(p)
            rss, anon = rss + r, anon + a
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)


def run_measured(
    cmd: Sequence[str],
    *,
    interval: float = SAMPLE_INTERVAL_S,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Measurement:
    """Run `cmd` to completion; its stdout is discarded, the end of stderr kept."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    sampler = _Sampler(proc.pid, interval)
    sampler.start()
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        stderr += f"\nkilled after --timeout {timeout} s"
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    return Measurement(seconds, sampler.peak_rss, sampler.peak_anon, proc.returncode, stderr[-STDERR_TAIL_CHARS:])


def best_of(runs: list[Measurement]) -> Measurement:
    """Repetitions of one command as one: fastest time, highest memory, first failure if any."""
    failed = [m for m in runs if m.returncode != 0]
    return Measurement(
        seconds=min(m.seconds for m in runs),
        peak_rss=max(m.peak_rss for m in runs),
        peak_anon=max(m.peak_anon for m in runs),
        returncode=failed[0].returncode if failed else 0,
        stderr_tail=(failed[0] if failed else runs[-1]).stderr_tail,
        runs_seconds=tuple(m.seconds for m in runs),
    )


def drop_page_cache() -> None:
    """Write back dirty pages and drop the page cache (needs root); makes the next read cold."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise PermissionError(
            f"cannot drop the page cache ({e.strerror}); run as root or leave out --drop-caches"
        ) from None
