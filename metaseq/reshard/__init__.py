"""Reshard fairscale FSDP checkpoints: any N shards -> any M shards, or one unflattened file.

    options -> plan (`plan`: inputs read, every output's tensors as runs of input bytes)
            -> write (`write`: one writer, byte copies) -> verify (`verify`, `--verify`)

`run.reshard(options)` does all of it; the CLI is `metaseq.scripts.reshard_fsdp`.
"""
from metaseq.errors import ReshardError
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.plan import Plan, describe_plan, plan_reshard
from metaseq.reshard.run import reshard, reshard_fsdp_checkpoints, reshard_shards

__all__ = ["Plan", "ReshardError", "ReshardOptions", "describe_plan", "plan_reshard", "reshard",
           "reshard_fsdp_checkpoints", "reshard_shards"]
