"""Run a function on W real FSDP ranks (CPU/gloo, `file://` rendezvous in a temp dir)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from metaseq.distributed.fsdp import init_distributed, lazy_init_all, start_ranks, wrap_model_fsdp
from metaseq.file_io import load_checkpoint
from metaseq.models.transformer_lm import ModelConfig, build_model


def run_on_ranks(fn, world_size: int, *args) -> None:
    """Call `fn(rank, world_size, *args)` on every rank; `fn` must be importable."""
    with tempfile.TemporaryDirectory(prefix="fsdp-test-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        start_ranks(_entry, (world_size, init_method, fn, args), world_size)


def _entry(rank: int, world_size: int, init_method: str, fn, args) -> None:
    init_distributed(rank, world_size, init_method)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def load_fsdp_model(shard_path: str | Path):
    """Build the FSDP model from a shard's cfg and load the shard with load_local_state_dict."""
    ckpt = load_checkpoint(shard_path)
    model = wrap_model_fsdp(build_model(ModelConfig.from_dict(ckpt["cfg"]["model"]), seed=0), torch.device("cpu"))
    lazy_init_all(model)
    model.load_local_state_dict(ckpt["model"])
    return model, ckpt


def save_full_state_dict(rank: int, world_size: int, shard_pattern: str, out_path: str) -> None:
    """Each rank loads its shard; rank 0 writes FSDP's own full `state_dict()`."""
    model, _ = load_fsdp_model(shard_pattern.format(i=rank))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(state, out_path)
