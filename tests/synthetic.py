"""Synthetic FSDP checkpoint shards, sharded by fairscale's own `_get_shard` (no process group).

The model has three FSDP instances with deliberately awkward sizes:
  ""                 27 elements, ties decoder.embed_tokens.weight -> decoder.output_projection.weight
  "decoder.layers.0" 38 elements, ties fc1.weight -> fc_tied.weight (a tie in a NESTED instance)
  "decoder.layers.1"  3 elements (fewer than most output shard counts)
plus a float buffer and an int buffer. Metadata follows `FSDP.local_metadata_dict()`.
Other structures (e.g. drawn by hypothesis) go through `make_model(instances=...)`.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel

# (fsdp_path, ((name, shape), ...), ((tied src, tied dst), ...)) per FSDP instance, root first.
Instances = tuple[tuple[str, tuple[tuple[str, tuple[int, ...]], ...], tuple[tuple[str, str], ...]], ...]
INSTANCES: Instances = (
    (
        "",
        (("decoder.embed_tokens.weight", (7, 3)), ("decoder.layer_norm.weight", (3,)), ("decoder.layer_norm.bias", (3,))),
        (("decoder.embed_tokens.weight", "decoder.output_projection.weight"),),
    ),
    (
        "decoder.layers.0",
        (("fc1.weight", (5, 3)), ("fc1.bias", (5,)), ("fc2.weight", (3, 5)), ("fc2.bias", (3,))),
        (("fc1.weight", "fc_tied.weight"),),
    ),
    ("decoder.layers.1", (("scale", (3,)),), ()),
)
STEP = 10
LOSS_SCALE = 128.0


class Opaque:
    """A type outside the checkpoint format: loading it runs its code (here: counts loads in LOADS)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __setstate__(self, state: dict) -> None:
        LOADS.append(state["value"])
        self.__dict__.update(state)


LOADS: list[int] = []  # values of the Opaque objects unpickled in this process


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class SyntheticModel:
    params: dict[str, torch.Tensor]  # full name -> full tensor, original shape
    buffers: dict[str, torch.Tensor]
    instances: Instances = INSTANCES

    def flat(self, idx: int) -> torch.Tensor:
        """Full (unsharded, unpadded) flat parameter of FSDP instance `idx`."""
        path, specs, _ = self.instances[idx]
        return torch.cat([self.params[join(path, name)].reshape(-1) for name, _ in specs])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What an unflattened consolidation must produce: params, tied copies, buffers."""
        out = dict(self.params)
        for path, _, ties in self.instances:
            for src, dst in ties:
                out[join(path, dst)] = self.params[join(path, src)]
        out.update(self.buffers)
        return out


def make_model(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    instances: Instances = INSTANCES,
    buffers: dict[str, torch.Tensor] | None = None,
) -> SyntheticModel:
    gen = torch.Generator().manual_seed(seed)
    params = {
        join(path, name): torch.randn(shape, generator=gen).to(dtype)
        for path, specs, _ in instances
        for name, shape in specs
    }
    if buffers is None:
        buffers = {"decoder.version": torch.tensor([3.0]), "decoder.layers.0.position_ids": torch.arange(4)}
    return SyntheticModel(params, buffers, instances)


def shard_flat(flat: torch.Tensor, world_size: int, rank: int) -> tuple[torch.Tensor, int]:
    """fairscale's own sharding of a flat parameter: (padded shard, padding)."""
    fake_fsdp = types.SimpleNamespace(world_size=world_size, rank=rank)
    return FullyShardedDataParallel._get_shard(fake_fsdp, flat)


def make_metadata(model: SyntheticModel, world_size: int, rank: int, *, legacy: bool = False) -> dict[str, Any]:
    param_metadata = []
    for idx, (path, specs, ties) in enumerate(model.instances):
        _, pad = shard_flat(model.flat(idx), world_size, rank)
        entry: dict[str, Any] = {"fsdp_path": path, "params": {"flat_param_0": {
            "names": [name for name, _ in specs],
            "shapes": [torch.Size(shape) for _, shape in specs],
            "numels": [torch.Size(shape).numel() for _, shape in specs],
            "padding": pad,
        }}}
        if not legacy:  # older files lack these two keys
            entry["no_broadcast_optim_state"] = False
            entry["shared_param_info"] = list(ties)
        param_metadata.append(entry)
    return {"param_metadata": param_metadata, "buffer_names": list(model.buffers)}


def make_shards(
    model: SyntheticModel,
    world_size: int,
    *,
    step: str = "int",
    optimizer: bool = True,
    legacy_metadata: bool = False,
) -> list[dict[str, Any]]:
    """One checkpoint dict per rank, with Adam-like state exp_avg = 2 * param, exp_avg_sq = param ** 2."""
    shards = []
    for rank in range(world_size):
        model_sd: dict[str, Any] = {}
        state = {}
        for idx, (path, _, _) in enumerate(model.instances):
            shard, _ = shard_flat(model.flat(idx), world_size, rank)
            model_sd[join(path, "flat_param_0")] = shard
            step_value = STEP if step == "int" else torch.tensor(float(STEP))
            state[idx] = {"step": step_value, "exp_avg": shard.float() * 2, "exp_avg_sq": shard.float() ** 2}
        model_sd.update({k: v.clone() for k, v in model.buffers.items()})
        ckpt: dict[str, Any] = {
            "model": model_sd,
            "shard_metadata": make_metadata(model, world_size, rank, legacy=legacy_metadata),
            "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FP16Optimizer",
                                   "lr_scheduler_state": {"best": None}, "num_updates": 42}],
            "extra_state": {"metrics": {}, "previous_training_time": 1.5,
                            "train_iterator": {"epoch": 1, "iterations_in_epoch": 7 + rank}},
            "cfg": {"distributed_training": {"distributed_world_size": world_size, "distributed_rank": rank,
                                             "use_sharded_state": True}},
        }
        if optimizer:
            ckpt["last_optimizer_state"] = {
                "state": state,
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0,
                                  "params": list(range(len(model.instances)))}],
                "loss_scale": LOSS_SCALE,
            }
        shards.append(ckpt)
    return shards


def write_shards(shards: list[dict[str, Any]], folder: Path, prefix: str = "checkpoint_last", part: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, shard in enumerate(shards):
        path = folder / f"{prefix}-model_part-{part}-shard{rank}.pt"
        torch.save(shard, path)
        paths.append(path)
    return paths


def assert_tree_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Recursive equality; tensors bit for bit, same dtype and shape."""
    if torch.is_tensor(expected):
        assert torch.is_tensor(actual), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {list(actual.shape)} != {list(expected.shape)}"
        assert torch.equal(actual, expected), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_tree_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
