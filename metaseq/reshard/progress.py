"""Progress of a reshard run: a tqdm bar on a terminal, plain log lines otherwise, nothing with --quiet.

Progress is counted in bytes of output tensors, reported as the writer copies them.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

__all__ = ["Progress", "make_progress"]

logger = logging.getLogger(__name__)


class Progress:
    """Bytes done out of `total_bytes` over `num_files` outputs, shown as `mode` says.

    "bar": a tqdm bar (bytes/s, ETA) on `stream`; "lines": one INFO line per output
    written, with the same figures; "off": nothing. `advance` takes a job's partial
    progress, `finish` completes it (late or excess reports of a finished job are ignored).
    """

    def __init__(self, total_bytes: int, num_files: int, *, mode: str = "lines", stream: TextIO | None = None,
                 label: str = "reshard") -> None:
        assert mode in ("bar", "lines", "off"), mode
        self.total, self.num_files, self.mode, self.label = total_bytes, num_files, mode, label
        self.done = self.files = 0
        self.credited: dict[int, int] = {}  # job -> bytes reported so far
        self.finished: set[int] = set()
        self.start = time.monotonic()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm  # only on a terminal

            self.bar = tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True, file=stream or sys.stderr,
                            dynamic_ncols=True, smoothing=0.1, mininterval=0.2)

    def advance(self, job: int, nbytes: int) -> None:
        if job not in self.finished:
            self.credited[job] = self.credited.get(job, 0) + nbytes
            self._add(nbytes)

    def finish(self, job: int, job_bytes: int, path: str, file_bytes: int) -> None:
        if job in self.finished:
            return
        self.finished.add(job)
        self._add(job_bytes - self.credited.pop(job, 0))
        self.files += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.files}/{self.num_files} files", refresh=False)
        elif self.mode == "lines":
            logger.info("wrote %s (%d bytes) [%s]", path, file_bytes, self.status())

    def status(self) -> str:
        """`3/16 files, 37%, 210.0 MB/s, ETA 12 s`."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        percent = min(100.0, 100 * self.done / self.total) if self.total else 100
        eta = max(0.0, self.total - self.done) / rate if rate > 0 else 0.0  # written bytes can pass the plan's count
        return f"{self.files}/{self.num_files} files, {percent:.0f}%, {rate / 1e6:.1f} MB/s, ETA {eta:.0f} s"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            logger.info("%s: %s in %.1f s", self.label, self.status().split(", ETA")[0], time.monotonic() - self.start)

    def _add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)


def make_progress(total_bytes: int, num_files: int, *, quiet: bool, stream: TextIO | None = None,
                  label: str = "reshard") -> Progress:
    """The CLI's choice: nothing with --quiet, a bar when `stream` (default stderr) is a terminal, else lines."""
    stream = stream or sys.stderr
    try:
        mode = "off" if quiet else ("bar" if stream.isatty() else "lines")
    except (AttributeError, ValueError):  # replaced or closed streams
        mode = "lines"
    return Progress(total_bytes, num_files, mode=mode, stream=stream, label=label)
