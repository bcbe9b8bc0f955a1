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


class ThreeLayers(torch.nn.Module):
    """A model wrapped the ways other trainers wrap theirs (see `wrap_other_ways`); odd sizes, so padding is uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.blk, self.post = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.blk(torch.tanh(self.pre(x))))).pow(2).sum()


class TiedLayers(ThreeLayers):
    """ThreeLayers with a `twin` of `pre` that shares its weight (its own bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.twin = torch.nn.Linear(5, 7)
        self.twin.weight = self.pre.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.blk(torch.tanh(self.pre(x) + self.twin(x))))).pow(2).sum()


class UnevenPair(torch.nn.Module):
    """Two flat parameters of 12 and 11 elements: 6 per rank at world size 2, with padding only in the second."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(5, 2), torch.nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(self.a(x)).sum() + self.b(torch.cat([x, x], 1)).sum()).pow(2)


class TwoWeights(torch.nn.Module):
    """Two elements: at world size 4, ranks 2 and 3 hold only padding (their files alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -0.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.sum(1, keepdim=True) * self.w).pow(2).sum()


def wrap_other_ways(kind: str):
    """"noflat": one FSDP instance with flatten_parameters=False (every parameter sharded on its own); "tied": the
    same with two weights tied (FSDP's local_state_dict holds the tied one under both names, its shard_metadata
    once); "mixed": such a root around `blk` in an instance of its own with flat parameters, so the root's
    parameters lie around it; "reversed": `UnevenPair` with `b` nested, flat (the optimizer is given its parameters
    in reverse); "tiny": `TwoWeights`, flat; "eps0": `ThreeLayers`, flat (its optimizer Adam with eps=0 and weight
    decay, which makes the padding NaN)."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    model, kwargs = TiedLayers() if kind == "tied" else ThreeLayers(), dict(compute_device=torch.device("cpu"),
                                                                            bucket_cap_mb=0)
    if kind == "mixed":
        model.blk = FSDP(model.blk, flatten_parameters=True, **kwargs)
    if kind in ("tiny", "eps0"):
        return FSDP(TwoWeights() if kind == "tiny" else model, **kwargs)
    if kind == "reversed":
        model = UnevenPair()
        model.b = FSDP(model.b, **kwargs)
        return FSDP(model, **kwargs)
    return FSDP(model, flatten_parameters=False, **kwargs)


def train_other_way(rank: int, world_size: int, kind: str, shard_pattern: str, full_path: str) -> None:
    """Two Adam steps of `wrap_other_ways(kind)`; every rank saves its shard, rank 0 also the full state dict."""
    model = wrap_other_ways(kind)
    params = list(model.parameters())
    settings = dict(eps=0.0, weight_decay=0.1) if kind == "eps0" else {}
    optim = torch.optim.Adam(params[::-1] if kind == "reversed" else params, lr=0.01, **settings)
    for step in range(2):
        optim.zero_grad()
        model(torch.linspace(-1, 1, 10).view(2, 5) * (rank + step + 1)).backward()
        optim.step()
    torch.save({"model": model.local_state_dict(), "shard_metadata": model.local_metadata_dict(),
                "last_optimizer_state": optim.state_dict(), "cfg": {}}, shard_pattern.format(i=rank))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, full_path)


def load_other_way(rank: int, world_size: int, kind: str, shard_pattern: str, full_path: str) -> None:
    """Load this rank's shard into a fresh `wrap_other_ways(kind)` (and its optimizer state, if any); rank 0 saves
    the full state dict it then holds."""
    model = wrap_other_ways(kind)
    lazy_init_all(model)
    ckpt = load_checkpoint(shard_pattern.format(i=rank))
    model.load_local_state_dict(ckpt["model"])
    if ckpt.get("last_optimizer_state") is not None:
        torch.optim.Adam(model.parameters(), lr=0.01).load_state_dict(ckpt["last_optimizer_state"])
    full = {k: v.clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, full_path)
