"""Run the reshard CLI and SIGKILL it at a chosen point while it writes (for test_reshard_safety.py).

    python tests/kill_harness.py POINT K <reshard_fsdp arguments...>

POINT is where the process kills itself with a real SIGKILL (no cleanup runs):
  bytes    once K bytes in all have gone to temp files (mid-file), through the writer's
           os.pwrite / os.copy_file_range;
  replace  just before the K-th rename of a complete temp file onto its output (K from 1);
  renamed  just after the K-th rename, before its folder is fsynced.
The hooks patch this process only; the tool itself has no test hooks.
"""
from __future__ import annotations

import os
import signal
import sys

from metaseq.scripts.reshard_fsdp import main


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str, k: int) -> None:
    counter = {"n": 0}
    if point == "bytes":
        _count_writes(k, counter)
    elif point in ("replace", "renamed"):  # the rename into place: os.replace, or os.link where none may be replaced
        for name in ("replace", "link"):
            os.__dict__[name] = _hooked(getattr(os, name), point, k, counter)
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def _hooked(rename, point: str, k: int, counter: dict[str, int]):
    def hooked(src: str, dst: str) -> None:
        counter["n"] += 1
        if point == "replace" and counter["n"] == k:
            _die()
        rename(src, dst)
        if point == "renamed" and counter["n"] == k:
            _die()

    return hooked


def _count_writes(k: int, counter: dict[str, int]) -> None:
    """Die once the writes of `metaseq.torchzip` have put K bytes into files."""
    pwrite, copy_range = os.pwrite, os.copy_file_range

    def counting_pwrite(fd: int, data, offset: int) -> int:
        room = k - counter["n"]
        if len(data) >= room:
            pwrite(fd, bytes(data)[:room], offset)
            _die()
        counter["n"] += len(data)
        return pwrite(fd, data, offset)

    def counting_copy_range(src: int, dst: int, count: int, offset_src=None, offset_dst=None) -> int:
        room = k - counter["n"]
        if count >= room:
            if room:
                copy_range(src, dst, room, offset_src, offset_dst)
            _die()
        n = copy_range(src, dst, count, offset_src, offset_dst)
        counter["n"] += n
        return n

    os.pwrite, os.copy_file_range = counting_pwrite, counting_copy_range


if __name__ == "__main__":
    _install(sys.argv[1], int(sys.argv[2]))
    sys.exit(main([*sys.argv[3:], "--num-workers", "1"]))  # one output at a time: kill points are reproducible
