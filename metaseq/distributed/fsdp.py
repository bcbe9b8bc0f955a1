"""Process-group start-up and fairscale FSDP wrapping for the LM."""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel.fully_sharded_data_parallel import get_fsdp_instances
from torch import nn

from metaseq.distributed.cpu_compat import patch_fsdp_for_cpu
from metaseq.torchzip import signals_held

__all__ = [
    "fsdp_instances",
    "init_distributed",
    "lazy_init_all",
    "start_ranks",
    "wrap_model_fsdp",
]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """Run `fn(rank, *args)` in `nprocs` processes and wait for all; any rank's error is raised.

    Without CUDA the ranks are forked: each shares the torch this process already imported
    instead of importing it again (about 3 s of CPU per rank on a small machine), and sets
    its own thread count in `init_distributed`. With CUDA they are spawned, fresh
    interpreters, since a forked child cannot use CUDA once its parent has touched it.
    Stopped while waiting (Ctrl-C, or SIGTERM as `cli_logging.sigterm_raises` raises it),
    this process stops the ranks before it goes: they would train on without it.
    """
    method = "spawn" if torch.cuda.is_available() else "fork"
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "Terminating process": as one failed
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=method)
    try:
        while not context.join():
            pass
    except BaseException as e:
        with signals_held():  # another Ctrl-C would leave them unreaped: their temp files would look in use
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join()
        first = _first_failure(context)
        if isinstance(e, mp.ProcessRaisedException) and first is not None:
            raise first from None
        raise
    finally:
        for path in context.error_files:  # torch leaves them in the temp folder
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _first_failure(context: mp.ProcessContext) -> mp.ProcessRaisedException | None:
    """The error of the rank that failed first, by when it wrote its traceback: torch raises the first error it
    sees, often another rank's that only says a peer is gone (gloo's "Connection reset by peer")."""
    written = [(os.stat(path).st_mtime_ns, i) for i, path in enumerate(context.error_files) if os.path.exists(path)]
    if not written:
        return None
    _, index = min(written)
    try:
        with open(context.error_files[index], "rb") as f:
            trace = pickle.load(f)  # written by torch's wrapper of this rank
    except (OSError, EOFError, pickle.UnpicklingError):  # cut short: torch's own report stands
        return None
    return mp.ProcessRaisedException(f"\n\n-- Process {index} terminated with the following error:\n{trace}", index,
                                     context.processes[index].pid)


def init_distributed(rank: int, world_size: int, init_method: str) -> torch.device:
    """Join the process group: NCCL with one GPU per rank when CUDA exists, else gloo."""
    # fairscale 0.4.13 uses torch's private *_base collectives; the notice is not ours to act on.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\._(all_gather|reduce_scatter)_base", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"TypedStorage is deprecated", category=UserWarning)  # its state dicts
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        torch.set_num_threads(int(os.environ.get("METASEQ_NUM_THREADS", "1")))
        patch_fsdp_for_cpu()
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return device


def wrap_model_fsdp(model: nn.Module, device: torch.device, *, process_group: dist.ProcessGroup | None = None) -> FSDP:
    """Each decoder layer is its own FSDP instance inside a root instance (flat params).

    `process_group`: the ranks that shard this model (with model parallelism, the data-parallel
    group of this rank's model part; it is also FSDP's reduce-scatter group). None: all ranks.
    """
    on_cpu = device.type == "cpu"
    kwargs = dict(
        flatten_parameters=True,
        compute_device=device,
        # gloo checks reduce-scatter shapes, which bucketing violates.
        bucket_cap_mb=0 if on_cpu else 25,
    )
    if process_group is not None:
        kwargs.update(process_group=process_group, process_group_reduce_scatter=process_group)
    model = model.to(device)
    layers = model.decoder.layers
    for k in range(len(layers)):
        layers[k] = FSDP(layers[k], **kwargs)
    return FSDP(model, **kwargs)


def fsdp_instances(model: nn.Module) -> list[FSDP]:
    """Root first, then nested instances in module order (the metadata order)."""
    return get_fsdp_instances(model)


def lazy_init_all(model: FSDP) -> None:
    """Run every instance's lazy init; `load_local_state_dict` needs it first."""
    for instance in fsdp_instances(model):  # root first, so children know they are not root
        instance._lazy_init()
