"""Synthetic raw FSDP checkpoints of a requested size, written straight in the on-disk format.

The structure is what `metaseq.cli.train` writes for the OPT-style LM (see
docs/checkpoint_format.md): a root FSDP instance holding the embeddings and the
final layer norm, one nested instance per decoder layer, the output projection
tied to the token embedding (recorded in the root's `shared_param_info`), a
`decoder.version` buffer and Adam state sharded like the parameters. Names and
shapes come from the real model built on the meta device, so they cannot drift.
Widths are chosen so that the layers' flat parameters do not divide evenly and
fairscale pads them.

With `real_structured`, the files take the structure of upstream metaseq's real OPT shards
where it matters for speed (see docs/checkpoint_format.md, "Checkpoints of upstream metaseq runs"):
`cfg` from `upstream_stubs.upstream_cfg` (`cfg["model"]` and `cfg["criterion"]` are
`argparse.Namespace`), int Adam steps and a float `loss_scale`, two `optimizer_history`
entries, `criterion` None, `task_state` {}, and a streaming `train_iterator` whose
`tokenization_cache` on rank 0 is a `metaseq.data.document_to_sequence.LockingArray` of
`TOKENIZATION_CACHE_DOCUMENTS` int32 counts: a 4 MB object in the pickle under a global
this package does not define (written through `upstream_stubs`' stand-in). Tensors stay
float32, so sizes and memory bounds are computed the same way.

Nothing here materializes the model. Each flat parameter is drawn, split with
fairscale's own `_get_shard`, and its per-rank pieces are appended to one
scratch file per rank; each rank's checkpoint is then `torch.save`d from
tensors mapped onto its scratch file. Anonymous memory stays near three copies
of the largest flat parameter whatever the checkpoint size.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import io
import mmap
import os
import types
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

from metaseq.benchmark.upstream_stubs import LockingArray, upstream_cfg, upstream_classes
from metaseq.file_io import atomic_torch_save, natural_sort_key, shard_file_name
from metaseq.models.transformer_lm import ModelConfig, TransformerLanguageModel

__all__ = [
    "FlatLayout",
    "SyntheticCheckpoint",
    "build_rank_checkpoint",
    "estimate_checkpoint_bytes",
    "flat_layouts",
    "model_config_for_width",
    "plan_model_config",
    "shard_numel",
    "write_synthetic_checkpoint",
]

FLOAT_BYTES = 4  # everything synthetic is float32, as the repo's training writes
STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # scratch order per flat parameter
ZIP_ALIGNMENT = 64  # torch.save pads each storage record to this boundary
MIN_EMBED_DIM = 8
NUM_UPDATES = 100
TOKENIZATION_CACHE_DOCUMENTS = 1_000_000  # real_structured: rank 0's LockingArray, 4 MB of int32
LOSS_SCALE = 16.0
UPSTREAM_KEYS = ("cfg", "model", "criterion", "optimizer_history", "task_state", "extra_state",
                 "last_optimizer_state", "shard_metadata")  # upstream Trainer.state_dict()'s order


@dataclass(frozen=True)
class FlatLayout:
    """One FSDP instance's flat parameter; names relative to `fsdp_path`, tied params once."""

    fsdp_path: str  # "" for the root instance
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    shared_param_info: tuple[tuple[str, str], ...]  # (src, dst), relative to fsdp_path

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def key(self) -> str:
        return f"{self.fsdp_path}.flat_param_0" if self.fsdp_path else "flat_param_0"


@dataclass(frozen=True)
class SyntheticCheckpoint:
    config: ModelConfig
    world_size: int
    paths: tuple[Path, ...]  # rank order (part by part)
    parts: int = 1

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    @property
    def glob_pattern(self) -> str:
        """What `--input-glob-pattern` takes; matches exactly `paths` (every part's)."""
        name = glob.escape(self.paths[0].name).replace("shard0.pt", "shard*.pt")
        if self.parts > 1:
            name = name.replace("model_part-0-", "model_part-*-")
        return os.path.join(glob.escape(str(self.paths[0].parent)), name)


def flat_layouts(config: ModelConfig) -> list[FlatLayout]:
    """Root instance first (embeddings, final norm), then one per decoder layer."""
    model = _meta_model(config)
    first_name: dict[int, str] = {}
    tied: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            tied.append((first_name[id(p)], name))
        else:
            first_name[id(p)] = name
    root = [(n, p.shape) for n, p in model.named_parameters() if not n.startswith("decoder.layers.")]
    layer = [(n, p.shape) for n, p in model.decoder.layers[0].named_parameters()]
    layouts = [_layout("", root, tied)]
    layouts += [_layout(f"decoder.layers.{k}", layer, []) for k in range(config.decoder_layers)]
    return layouts


def _meta_model(config: ModelConfig) -> TransformerLanguageModel:
    """The model on the meta device (no data), with one layer: all layers are alike."""
    with torch.device("meta"):
        return TransformerLanguageModel(dataclasses.replace(config, decoder_layers=1))


def _layout(fsdp_path: str, params: list[tuple[str, torch.Size]], tied: list[tuple[str, str]]) -> FlatLayout:
    names, shapes = zip(*params)
    return FlatLayout(fsdp_path, tuple(names), tuple(torch.Size(s) for s in shapes), tuple(tied))


def _buffers(config: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's buffers; the only one is fairseq's `version` marker, which holds 3.0."""
    return {name: torch.full(b.shape, 3.0) for name, b in _meta_model(config).named_buffers()}


def model_config_for_width(embed_dim: int, layers: int, parts: int = 1) -> ModelConfig:
    """OPT-like proportions; odd offsets keep flat parameters from dividing evenly.

    `parts` > 1: the width is rounded up to a multiple of 4, and heads, vocabulary and FFN
    width are divisible by 4 (model parallelism up to 4 parts); flat parameters still pad.
    """
    if parts > 1:
        embed_dim += -embed_dim % 4
    heads = max(h for h in range(1, 33) if embed_dim % h == 0 and (parts == 1 or h % 4 == 0))
    ffn, vocab = (4 * embed_dim + 3, 16 * embed_dim + 7) if parts == 1 else (4 * embed_dim + 4, 16 * embed_dim + 4)
    return ModelConfig(
        decoder_layers=layers,
        decoder_embed_dim=embed_dim,
        decoder_attention_heads=heads,
        decoder_ffn_embed_dim=ffn,
        max_target_positions=2 * embed_dim + 5,
        vocab_size=vocab,
    )


def _width(i: int) -> int:
    """The i-th allowed width: 8, 10, 14, 16, 20, ... (even, not a multiple of 3).

    A layer's flat parameter has 12*D^2 + 19*D + 3 elements (ffn 4D+3), which is
    then odd and not divisible by 3, so world sizes 2, 3, 4, 6, 8, 16, ... pad.
    """
    return MIN_EMBED_DIM + 6 * (i // 2) + 2 * (i % 2)


def plan_model_config(size_bytes: int, world_size: int, *, layers: int = 12, real_structured: bool = False,
                      parts: int = 1) -> ModelConfig:
    """The model whose `world_size` shard files (model + Adam state) total closest to `size_bytes`."""
    def estimate(i: int) -> int:
        config = model_config_for_width(_width(i), layers, parts)
        return estimate_checkpoint_bytes(config, world_size, real_structured=real_structured)

    smallest = estimate(0)
    if size_bytes < smallest:
        raise ValueError(
            f"--size-gb={size_bytes / 1e9:g} is too small for {world_size} shards of a {layers}-layer "
            f"model; the smallest such checkpoint takes {smallest / 1e9:.4f} GB: raise --size-gb"
        )
    lo, hi = 0, 1
    while estimate(hi) <= size_bytes:  # now estimate(lo) <= size < estimate(hi)
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if estimate(mid) <= size_bytes else (lo, mid)
    best = min((lo, hi), key=lambda i: abs(estimate(i) - size_bytes))
    return model_config_for_width(_width(best), layers, parts)


def estimate_checkpoint_bytes(config: ModelConfig, world_size: int, *, real_structured: bool = False) -> int:
    """Bytes of all `world_size` shard files: tensor data plus one serialized skeleton per file.

    With `real_structured`, steps are ints (no tensors) and only rank 0's skeleton holds the
    tokenization cache, so the other ranks' skeleton is measured on its own.
    """
    layouts, buffers = flat_layouts(config), _buffers(config)
    skeleton = _skeleton_bytes(config, layouts, world_size, 0, real_structured)
    others = _skeleton_bytes(config, layouts, world_size, 1, real_structured) if real_structured else skeleton
    steps = 0 if real_structured else len(layouts)  # one 0-dim Adam step tensor each
    num_tensors = len(layouts) * len(STATE_KINDS) + steps + len(buffers)
    floats = sum(shard_numel(layout.numel, world_size) for layout in layouts) * len(STATE_KINDS)
    floats += steps + sum(b.numel() for b in buffers.values())
    per_file = floats * FLOAT_BYTES + ZIP_ALIGNMENT * num_tensors
    return world_size * per_file + skeleton + (world_size - 1) * others


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per rank, read off fairscale's sharding of a meta tensor (no data)."""
    shard, _ = FSDP._get_shard(types.SimpleNamespace(world_size=world_size, rank=0), torch.empty(numel, device="meta"))
    return shard.numel()


def _skeleton_bytes(config: ModelConfig, layouts: list[FlatLayout], world_size: int, rank: int,
                    real_structured: bool) -> int:
    """Serialized size of rank `rank`'s checkpoint with empty tensors."""
    empty = [{kind: torch.empty(0) for kind in STATE_KINDS} for _ in layouts]
    ckpt = build_rank_checkpoint(config, layouts, empty, [0] * len(layouts), rank=rank, world_size=world_size,
                                 real_structured=real_structured)
    buf = io.BytesIO()
    with upstream_classes():
        torch.save(ckpt, buf)
    return buf.tell()


def build_rank_checkpoint(
    config: ModelConfig,
    layouts: list[FlatLayout],
    flats: list[dict[str, torch.Tensor]],
    paddings: list[int],
    *,
    rank: int,
    world_size: int,
    real_structured: bool = False,
) -> dict[str, Any]:
    """One rank's checkpoint dict in the FORMAT.md layout (pure: no I/O).

    `flats[k]` holds this rank's 1-D pieces of flat parameter k under
    `STATE_KINDS`, all padded with `paddings[k]` zeros as fairscale pads them.
    `real_structured`: upstream metaseq's structure (see the module docstring).
    """
    buffers = _buffers(config)
    model = {layouts[0].key: flats[0]["param"], **buffers}  # key order as FSDP writes it
    model.update({layout.key: flat["param"] for layout, flat in zip(layouts[1:], flats[1:])})
    param_metadata = [
        {
            "fsdp_path": layout.fsdp_path,
            "params": {"flat_param_0": {
                "names": list(layout.names),
                "shapes": list(layout.shapes),
                "numels": [s.numel() for s in layout.shapes],
                "padding": padding,
            }},
            "no_broadcast_optim_state": False,
            "shared_param_info": list(layout.shared_param_info),
        }
        for layout, padding in zip(layouts, paddings)
    ]
    state = {
        k: {"step": torch.tensor(float(NUM_UPDATES)), "exp_avg": flat["exp_avg"], "exp_avg_sq": flat["exp_avg_sq"]}
        for k, flat in enumerate(flats)
    }
    lr = 3e-4
    group = {"lr": lr, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
             "fused": None, "params": list(range(len(flats)))}
    ckpt = {
        "model": model,
        "shard_metadata": {"param_metadata": param_metadata, "buffer_names": list(buffers)},
        "last_optimizer_state": {"state": state, "param_groups": [group]},
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {"lr": lr}, "num_updates": NUM_UPDATES}],
        "extra_state": {"metrics": {"loss": 2.0}, "previous_training_time": 3600.0,
                        "train_iterator": {"samples_seen": 8 * NUM_UPDATES}},
        "cfg": _cfg(config, rank, world_size),
    }
    return _upstream_structure(ckpt, config, rank, world_size) if real_structured else ckpt


def _upstream_structure(ckpt: dict[str, Any], config: ModelConfig, rank: int, world_size: int) -> dict[str, Any]:
    """`ckpt` reshaped like an upstream OPT shard of global rank `rank` (P = 1): see the module docstring."""
    osd = ckpt["last_optimizer_state"]
    for entry in osd["state"].values():
        entry["step"] = NUM_UPDATES  # upstream's Adam counts in a Python int
    osd["loss_scale"] = LOSS_SCALE
    last = {**ckpt["optimizer_history"][0], "optimizer_name": "MemoryEfficientFP16Optimizer"}
    iterator = {"epoch": 1, "sequences_consumed": [4 * NUM_UPDATES] * 2, "n": NUM_UPDATES,
                "tokenization_cache": _tokenization_cache() if rank == 0 else None}
    ckpt.update(
        cfg=upstream_cfg(config, rank=rank, world_size=world_size, lr=osd["param_groups"][0]["lr"]),
        criterion=None,
        task_state={},
        optimizer_history=[{**last, "num_updates": NUM_UPDATES // 2}, last],  # restarted once
    )
    ckpt["extra_state"].update(train_iterator=iterator, ewm_loss=2.0)
    return {key: ckpt[key] for key in UPSTREAM_KEYS}


@functools.lru_cache(maxsize=1)
def _tokenization_cache() -> LockingArray:
    """Rank 0's data-loader state: an int32 token count per document (shared; never mutated)."""
    lengths = np.random.default_rng(0).integers(0, 2048, TOKENIZATION_CACHE_DOCUMENTS, dtype=np.int32)
    return LockingArray(lengths, num_workers=2)


def _cfg(config: ModelConfig, rank: int, world_size: int) -> dict[str, Any]:
    """Same shape as `metaseq.cli.train.checkpoint_cfg`, so loaders find the model config."""
    return {
        "model": config.to_dict(),
        "distributed_training": {"distributed_world_size": world_size, "distributed_rank": rank,
                                 "ddp_backend": "fully_sharded", "use_sharded_state": True},
        "optimization": {"lr": [3e-4], "max_update": NUM_UPDATES, "batch_size": 8},
        "task": {"data": "synthetic", "seq_len": config.max_target_positions},
        "common": {"seed": 0},
    }


def write_synthetic_checkpoint(
    out_dir: str | os.PathLike,
    config: ModelConfig,
    world_size: int,
    *,
    prefix: str = "checkpoint_last",
    seed: int = 0,
    real_structured: bool = False,
) -> SyntheticCheckpoint:
    """Write `{prefix}-model_part-0-shard{r}.pt` for r < world_size into `out_dir`.

    `real_structured`: upstream metaseq's structure (see the module docstring); reading such
    files back needs `upstream_stubs.upstream_classes()` registered.

    Peak anonymous memory is about three copies of the largest flat parameter;
    disk traffic is twice the checkpoint size (scratch file, then the shard).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layouts = flat_layouts(config)
    scratch = [out_dir / f".synth-scratch-{r}.bin" for r in range(world_size)]
    paths = tuple(out_dir / shard_file_name(prefix, 0, r) for r in range(world_size))
    try:
        lengths, paddings = _write_scratch(layouts, scratch, seed)
        for r in range(world_size):
            _save_rank(scratch[r], paths[r], config, layouts, lengths, [p[r] for p in paddings], r, world_size,
                       real_structured)
            scratch[r].unlink()
    finally:
        for p in scratch:
            p.unlink(missing_ok=True)
    assert sorted(paths, key=natural_sort_key) == list(paths)
    return SyntheticCheckpoint(config, world_size, paths)


def _write_scratch(layouts: list[FlatLayout], scratch: list[Path], seed: int) -> tuple[list[int], list[list[int]]]:
    """Append every rank's pieces to its scratch file; per flat param: length, and padding per rank."""
    gen = torch.Generator().manual_seed(seed)
    lengths, paddings = [], []
    with ExitStack() as stack:
        files = [stack.enter_context(open(p, "wb")) for p in scratch]
        for layout in layouts:
            param = torch.randn(layout.numel, generator=gen).mul_(0.02)
            for full in _optimizer_like(param):
                length, pads = _append_shards(full, files)
            lengths.append(length)
            paddings.append(pads)
    return lengths, paddings


def _optimizer_like(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """param, exp_avg, exp_avg_sq in `STATE_KINDS` order, one at a time to bound memory."""
    yield param
    yield param * 1e-3
    yield param.square().mul_(1e-6)


def _append_shards(full: torch.Tensor, files: list[BinaryIO]) -> tuple[int, list[int]]:
    """Split `full` exactly as FSDP does and append rank r's piece to files[r]."""
    world_size = len(files)
    pads = []
    for rank, f in enumerate(files):
        shard, pad = FSDP._get_shard(types.SimpleNamespace(world_size=world_size, rank=rank), full)
        f.write(shard.numpy())
        pads.append(pad)
    return shard.numel(), pads


def _save_rank(
    scratch: Path,
    path: Path,
    config: ModelConfig,
    layouts: list[FlatLayout],
    lengths: list[int],
    paddings: list[int],
    rank: int,
    world_size: int,
    real_structured: bool = False,
) -> None:
    """`torch.save` rank `rank`'s checkpoint from tensors mapped onto its scratch file."""
    with open(scratch, "rb") as f:
        # Copy-on-write: torch.frombuffer wants a writable buffer; nothing is written.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flats, offset = [], 0
    for length in lengths:
        flat = {}
        for kind in STATE_KINDS:
            flat[kind] = torch.frombuffer(mapped, dtype=torch.float32, count=length, offset=offset)
            offset += length * FLOAT_BYTES
        flats.append(flat)
    assert offset == len(mapped), f"scratch {scratch}: mapped {offset} of {len(mapped)} bytes"
    ckpt = build_rank_checkpoint(config, layouts, flats, paddings, rank=rank, world_size=world_size,
                                 real_structured=real_structured)
    with upstream_classes():  # the stand-in for upstream's LockingArray (real_structured)
        atomic_torch_save(ckpt, path)
    # The tensors keep `mapped` alive; dropping them here unmaps the scratch file.
