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

Model parallelism (`fairscale.nn.model_parallel`): its layers and collectives run on
CPU/gloo as they are. Only its CUDA RNG tracker (`get_cuda_rng_tracker().fork()`,
which model-parallel dropout runs under, seeded by `model_parallel_cuda_manual_seed`)
needs CUDA. The model has no dropout, so nothing forks the tracker;
`seed_model_parallel_rng` seeds it where CUDA exists and does nothing on CPU. A model
that adds dropout in model-parallel regions needs a CPU stand-in for the tracker here.
"""
from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import torch

__all__ = ["patch_fsdp_for_cpu", "seed_model_parallel_rng"]

logger = logging.getLogger(__name__)

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


def seed_model_parallel_rng(seed: int) -> bool:
    """fairscale's `model_parallel_cuda_manual_seed` where CUDA exists (its banner goes to the
    log, not stdout); on CPU nothing needs the tracker. Returns True if it seeded."""
    if not torch.cuda.is_available():
        return False
    from fairscale.nn.model_parallel import model_parallel_cuda_manual_seed

    with contextlib.redirect_stdout(io.StringIO()) as banner:
        model_parallel_cuda_manual_seed(seed)
    logger.debug("%s", banner.getvalue().strip())
    return True
