"""Reshard fairscale FSDP checkpoints: any N shards -> any M shards, or one unflattened file.

Pure state-dict logic lives in `ranges`, `layout`, `optim` and `build`; file
handling (glob, load, atomic save) in `driver`. The CLI is `metaseq.scripts.reshard_fsdp`.
"""
from metaseq.reshard.build import consolidate_shards, reshard_shards
from metaseq.reshard.driver import plan_reshard_fsdp, reshard_fsdp_checkpoints
from metaseq.reshard.schema import ReshardError

__all__ = [
    "ReshardError",
    "consolidate_shards",
    "plan_reshard_fsdp",
    "reshard_fsdp_checkpoints",
    "reshard_shards",
]
