"""Let fairscale's FSDP run on CPU-only machines (gloo). The ONE place for this.

fairscale 0.4.13 calls CUDA stream APIs unconditionally in its forward/backward
hooks (`torch.cuda.current_stream()`, `torch.cuda.stream(...)`,
`Tensor.record_stream`, `self._streams["post_backward"]`), even though it never
needs them for CPU tensors. When CUDA is absent, `patch_fsdp_for_cpu()` turns
exactly those calls into no-ops:

- `torch.cuda.current_stream`, `torch.cuda.stream`, `torch.cuda.synchronize`
  return a do-nothing stream / context;
- `Tensor.record_stream` does nothing;
- FSDP's stream dict gets the same do-nothing stream under its three names, so
  `assert current_stream() == self._streams["post_backward"]` holds.

Nothing about sharding changes: state dicts, metadata and padding stay fairscale's.
Callers must also pass `bucket_cap_mb=0` (see `metaseq.distributed.fsdp`): gloo
checks reduce-scatter shapes, which bucketing violates. On a machine with CUDA
this module does nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["patch_fsdp_for_cpu"]

_STREAM_NAMES = ("fp32_to_fp16", "all_gather", "post_backward")
_patched = False


class _NullStream:
    """Stands in for a CUDA stream: every synchronisation is already done on CPU."""

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


_NULL_STREAM = _NullStream()


def patch_fsdp_for_cpu() -> bool:
    """Install the no-op stream shims if CUDA is absent. Idempotent; returns True if active."""
    global _patched
    if torch.cuda.is_available():
        return False
    if _patched:
        return True
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.cuda.current_stream = lambda device=None: _NULL_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None

    setup_streams = FSDP._setup_streams

    def _setup_null_streams(self: FSDP) -> None:
        setup_streams(self)  # shares one dict object with every child instance
        if self._is_root:
            for name in _STREAM_NAMES:
                self._streams.setdefault(name, _NULL_STREAM)

    FSDP._setup_streams = _setup_null_streams
    _patched = True
    return True
