"""Rank layout for tensor model parallelism, and the FSDP-wrapped model of one rank.

W ranks run P model parts, each FSDP-sharded over D = W / P data-parallel ranks, laid
out as fairscale's `initialize_model_parallel` does: global rank = dp_rank * P + mp_rank,
so the P parts of one data-parallel replica are neighbouring ranks. Rank (mp_rank j,
dp_rank i) writes `checkpoint_*-model_part-{j}-shard{i}.pt`. With P = 1 nothing of
fairscale's model parallelism is set up: the plain model, FSDP over all ranks.
"""
from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.model_parallel import destroy_model_parallel, get_data_parallel_group, initialize_model_parallel

from metaseq.distributed.cpu_compat import seed_model_parallel_rng
from metaseq.distributed.fsdp import wrap_model_fsdp
from metaseq.models.model_parallel import build_model_parallel
from metaseq.models.transformer_lm import ModelConfig, build_model

__all__ = ["RankLayout", "build_fsdp_model", "data_parallel_group", "init_model_parallel", "shutdown_model_parallel"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankLayout:
    """Where global `rank` of `world_size` sits: model part `mp_rank`, FSDP shard `dp_rank`."""

    rank: int
    world_size: int
    model_parallel_size: int = 1

    @property
    def mp_rank(self) -> int:
        return self.rank % self.model_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.model_parallel_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.model_parallel_size


def init_model_parallel(layout: RankLayout, seed: int) -> None:
    """fairscale's model-parallel and data-parallel groups (P > 1 only); their banner goes to the log."""
    if layout.model_parallel_size == 1:
        return
    with contextlib.redirect_stdout(io.StringIO()) as banner:
        initialize_model_parallel(layout.model_parallel_size)
    logger.debug("%s", banner.getvalue().strip())
    seed_model_parallel_rng(seed)


def shutdown_model_parallel(layout: RankLayout) -> None:
    """Forget fairscale's groups (before the process group is destroyed)."""
    if layout.model_parallel_size > 1:
        destroy_model_parallel()


def data_parallel_group(layout: RankLayout) -> dist.ProcessGroup | None:
    """The ranks holding the other shards of this rank's model part (None: all ranks, P = 1)."""
    return None if layout.model_parallel_size == 1 else get_data_parallel_group()


def build_fsdp_model(model_cfg: ModelConfig, *, seed: int, device: torch.device, layout: RankLayout) -> FSDP:
    """This rank's model: the plain model (P = 1) or its model part, FSDP-sharded over the data-parallel ranks."""
    if layout.model_parallel_size == 1:
        return wrap_model_fsdp(build_model(model_cfg, seed=seed), device)
    return wrap_model_fsdp(build_model_parallel(model_cfg, seed), device, process_group=data_parallel_group(layout))
