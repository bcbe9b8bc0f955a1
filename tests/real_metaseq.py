"""Shards with the exact structure of upstream metaseq's OPT training checkpoints, from real fairscale FSDP.

    from real_metaseq import load_real, write_real_run

    paths = write_real_run(tmp, 2, fp16_adam_stats=True, updates=2)   # [...-model_part-0-shard0.pt, ...shard1.pt]
    ckpt = load_real(paths[0])        # torch.load with the upstream stand-ins registered (trusted files only)

`write_real_run` trains this project's LM (`model_config`) for `updates` real AdamW steps under
fairscale FSDP on W = `world_size` CPU/gloo ranks per model part (P = `model_parallel_size`
parts through fairscale's tensor-parallel layers; global rank r = dp_rank * P + mp_rank, as
`mp_harness`), then every rank shapes what FSDP and torch report the way upstream's
`Trainer.state_dict()` + `utils.move_to_cpu(cast_to_fp32=False)` + `Trainer.save_checkpoint`
do, and `torch.save`s `checkpoint_last-model_part-{j}-shard{i}.pt`. Each file holds, in
upstream's key order:

- `cfg`: a plain dict (`OmegaConf.to_container`) with a `_name` key in every section
  (`common`, `distributed_training`, `dataset`, `optimization`, `checkpoint`, `task`,
  `optimizer`, `lr_scheduler`, `ema`); `cfg["model"]` and `cfg["criterion"]` are
  `argparse.Namespace` copies of one args namespace (upstream's legacy-args conversion),
  with `_name` "transformer_lm_megatron" / "vocab_parallel_cross_entropy" (P > 1) or
  "cross_entropy", the sizes (`decoder_embed_dim`, `decoder_layers`, `decoder_attention_heads`,
  `decoder_ffn_embed_dim`, `max_target_positions`, no `vocab_size`) and OPT's flags
  (`no_scale_embedding`, `share_decoder_input_output_embed`, ...): `ModelConfig.from_dict`
  rebuilds `model_config(P)` from it. Per rank: `distributed_training.distributed_rank`
  (global rank), `.device_id` (rank % 8), `checkpoint.checkpoint_suffix` ("-model_part-{j}");
  `common.model_parallel_size` = P, `distributed_training.distributed_world_size` = W * P,
  `use_sharded_state` True, `ddp_backend` "fully_sharded", `common.memory_efficient_fp16` True.
- `model`: `local_state_dict()` (flat params, then the `decoder.version` buffer), every
  tensor cast to fp16 (`--memory-efficient-fp16`: no fp32 master copy anywhere).
- `criterion`: None. `task_state`: {}.
- `optimizer_history`: 2 entries (the run was restarted once), each `criterion_name`
  ("VocabParallelCrossEntropyCriterion" or "CrossEntropyCriterion"), `optimizer_name`
  ("MemoryEfficientFP16Optimizer"), `lr_scheduler_state` ({"best": None}), `num_updates`
  (`updates // 2`, then `updates`).
- `extra_state`: `metrics` (metaseq's `metrics.state_dict()`: {aggregator: [(priority, name,
  meter class, meter state)]}, the AverageMeter states holding 0-dim float tensors),
  `previous_training_time` (float), `ewm_loss` (float), `train_iterator`, `val_loss` (float);
  with `ema`: `ema` (this rank's flat EMA shards in fp16) and `ema_fp32_params` (the same in
  fp32), both keyed exactly like `model` (flat params and buffer), each flat tensor as long
  and padded as the model's on this rank: they are the local state of a second model (seed
  + 1000) sharded by the same real FSDP. With P > 1: `rng_tracker_states`
  ({"model-parallel-rng": 16 uint8 bytes (Philox seed, offset)}), different on every rank.
  `train_iterator` of a streaming run (upstream's `StreamingEpochBatchIterator.state_dict()`):
  {"epoch", "sequences_consumed" (one per loader worker), "tokenization_cache", "n"} where
  `tokenization_cache` is a `metaseq.data.document_to_sequence.LockingArray` on global rank 0
  (`expected_tokenization_cache(seed)`) and None elsewhere; otherwise fairseq's
  `EpochBatchIterator.state_dict()` {"version": 2, "epoch", "iterations_in_epoch", "shuffle"}.
- `last_optimizer_state`: torch's AdamW `state_dict()` in metaseq's FusedAdamV1 form:
  `state` {k: {"step": int, "exp_avg", "exp_avg_sq"}} (fp32 moments, as long as flat param k
  on this rank), `param_groups` [{"lr", "bias_correction", "betas" (tuple), "eps",
  "weight_decay", "max_grad_norm", "params"}], `loss_scale` (float, `LOSS_SCALE`). With
  `fp16_adam_stats`: moments stored as fp16 `(v / scale).half()` with this rank's 0-dim fp32
  `exp_avg_scale` / `exp_avg_sq_scale` = 1e-8 + max|v| / 65504 (so value = fp16 moment x scale).
- `shard_metadata`: `local_metadata_dict()` with every `torch.Size` turned into a tuple.

`restored=True` also writes `restored.pt` like upstream's `convert_to_singleton`: the
unflattened fp16 parameters of the same trained model (model parts glued) under their
original names (the tied `decoder.output_projection.weight` and the buffers left out), a
real omegaconf `DictConfig` cfg (struct mode, `cfg.model` a Namespace with `arch`
"transformer_lm"), and rank 0's other keys without `last_optimizer_state`, `shard_metadata`
and the EMA shards. `report=True` writes `fairscale_report.pt`: per global rank, what
fairscale and torch reported before the shaping ("metadata", "model" in fp32, "optimizer")
and what a fresh FSDP model reports after loading the written file ("reloaded").

The `LockingArray` pickles under upstream's module name, which nothing defines here:
`load_real` (or `with upstream_classes(): torch.load(..., weights_only=False)`) brings it
back, equal to the original; `reload_in_fsdp` loads the files into fresh FSDP models.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import get_model_parallel_group

from metaseq.benchmark.upstream_stubs import (
    ADAM_BETAS,
    ADAM_EPS,
    LOADER_WORKERS,
    UPSTREAM_MODULE,
    WEIGHT_DECAY,
    LockingArray,
    upstream_cfg,
    upstream_classes,
)
from metaseq.cli.train import train_step
from metaseq.distributed.fsdp import lazy_init_all
from metaseq.distributed.model_parallel import RankLayout, build_fsdp_model, init_model_parallel, shutdown_model_parallel
from metaseq.file_io import shard_file_name
from metaseq.models.partition import merge_state_dicts
from metaseq.models.transformer_lm import ModelConfig

from fsdp_harness import run_on_ranks  # tests/ helpers
from mp_harness import run_on_mp_ranks

__all__ = [
    "EMA_KEYS",
    "FP16_MAX",
    "LOSS_SCALE",
    "REPORT",
    "RESTORED",
    "UPSTREAM_MODULE",
    "LockingArray",
    "RealRunSpec",
    "expected_tokenization_cache",
    "load_real",
    "model_config",
    "real_run_paths",
    "reload_in_fsdp",
    "train_iterator_state",
    "upstream_optimizer_state",
    "upstream_cfg",
    "upstream_classes",
    "write_real_run",
    "write_real_runs",
    "write_restored",
]

PREFIX = "checkpoint_last"
FP16_MAX = 65504.0  # FusedAdamV1.FLOAT16_MAX
LOSS_SCALE = 16.0
LR = 1e-3
SEQ_LEN = 16
EMA_SEED_OFFSET = 1000
EMA_KEYS = ("ema", "ema_fp32_params")
NUM_DOCUMENTS = 50
TIED = "decoder.output_projection.weight"
RESTORED, REPORT = "restored.pt", "fairscale_report.pt"


@dataclass(frozen=True)
class RealRunSpec:
    """The options of `write_real_run`, sent to every rank."""

    world_size: int  # FSDP (data-parallel) ranks per model part
    model_parallel_size: int = 1
    ema: bool = True
    fp16_adam_stats: bool = False
    streaming: bool = True
    seed: int = 0
    updates: int = 1
    restored: bool = False
    report: bool = False


def model_config(model_parallel_size: int = 1) -> ModelConfig:
    """P = 1: the default model (a layer's flat parameter has 8201 elements: padded at W = 2, 3, 4).
    P > 1: `mp_harness`'s sizes (2 heads, FFN 76), which P = 2 divides (4343 elements per layer per part)."""
    if model_parallel_size == 1:
        return ModelConfig()
    return ModelConfig(decoder_attention_heads=2, decoder_ffn_embed_dim=76)


def real_run_paths(folder: str | Path, world_size: int, model_parallel_size: int = 1) -> list[Path]:
    """The files of a run: part 0's shards 0..W-1 first, then part 1's, ..."""
    return [Path(folder) / shard_file_name(PREFIX, j, i) for j in range(model_parallel_size) for i in range(world_size)]


def write_real_run(
    folder: str | Path,
    world_size: int,
    *,
    ema: bool = True,
    fp16_adam_stats: bool = False,
    streaming: bool = True,
    model_parallel_size: int = 1,
    seed: int = 0,
    updates: int = 1,
    restored: bool = False,
    report: bool = False,
) -> list[Path]:
    """Train on W * P real ranks and write upstream-structured shards (see the module docstring).

    Deterministic for given arguments. Returns `real_run_paths(folder, world_size, model_parallel_size)`.
    """
    spec = RealRunSpec(world_size, model_parallel_size, ema, fp16_adam_stats, streaming, seed, updates, restored, report)
    return write_real_runs([(folder, spec)])[0]


def write_real_runs(runs: Sequence[tuple[str | Path, RealRunSpec]]) -> list[list[Path]]:
    """Several `write_real_run`s, one after the other on ONE set of spawned ranks (each spawn costs
    seconds of imports per rank); every run needs the same number of ranks W * P."""
    for _, spec in runs:
        if min(spec.world_size, spec.model_parallel_size, spec.updates) < 1:
            raise ValueError(f"{spec}: world_size, model_parallel_size and updates must be >= 1")
    ranks = {spec.world_size * spec.model_parallel_size for _, spec in runs}
    if len(ranks) != 1:
        raise ValueError(f"runs need the same world_size * model_parallel_size, not {sorted(ranks)}")
    for folder, _ in runs:
        Path(folder).mkdir(parents=True, exist_ok=True)
    run_on_ranks(_write_runs_on_rank, ranks.pop(), [(str(folder), spec) for folder, spec in runs])
    return [real_run_paths(folder, spec.world_size, spec.model_parallel_size) for folder, spec in runs]


def _write_runs_on_rank(rank: int, world_size: int, runs: list[tuple[str, RealRunSpec]]) -> None:
    for folder, spec in runs:
        layout = RankLayout(rank, world_size, spec.model_parallel_size)
        init_model_parallel(layout, seed=spec.seed)
        try:
            _write_on_rank(layout, spec, folder)
        finally:
            shutdown_model_parallel(layout)


def load_real(path: str | Path) -> dict[str, Any]:
    """One file as upstream metaseq loads it (`weights_only=False`: only for files these helpers wrote)."""
    with upstream_classes():
        return torch.load(path, map_location="cpu", weights_only=False)


def _write_on_rank(layout: RankLayout, spec: RealRunSpec, folder: str) -> None:
    device = torch.device("cpu")
    model = build_fsdp_model(model_config(spec.model_parallel_size), seed=spec.seed, device=device, layout=layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS,
                                  weight_decay=WEIGHT_DECAY)
    losses = [train_step(model, optimizer, _batch(spec.seed, u, layout.dp_size), layout, device)
              for u in range(spec.updates)]
    ckpt = _rank_checkpoint(model, optimizer, spec, layout, losses)
    path = Path(folder) / shard_file_name(PREFIX, layout.mp_rank, layout.dp_rank)
    with upstream_classes():
        torch.save(ckpt, path)
    if spec.restored:
        _write_restored_on_rank(model, layout, ckpt, Path(folder) / RESTORED)
    if spec.report:
        _report_on_rank(model, optimizer, layout, path, Path(folder) / REPORT)


def _write_restored_on_rank(model: Any, layout: RankLayout, ckpt: dict[str, Any], path: Path) -> None:
    """Every rank unflattens its part (collective); rank 0 glues the parts and writes `restored.pt`."""
    part = _unflattened_params(model)
    if layout.model_parallel_size > 1:
        parts: list[Any] = [None] * layout.model_parallel_size
        dist.all_gather_object(parts, part, group=get_model_parallel_group())
        part = merge_state_dicts(parts)
    if layout.rank == 0:
        write_restored(path, part, ckpt)


def _report_on_rank(model: Any, optimizer: torch.optim.Optimizer, layout: RankLayout, path: Path,
                    report_path: Path) -> None:
    """What fairscale and torch reported before the shaping, and a fresh FSDP model's view of the
    written file (`reload_in_fsdp`); rank 0 saves the list (one per global rank) to `report_path`."""
    report = {"metadata": model.local_metadata_dict(),
              "model": {k: v.detach().clone() for k, v in model.local_state_dict().items()},
              "optimizer": copy.deepcopy(optimizer.state_dict()),
              "reloaded": _reload_report(layout, path)}
    _gather_to_file(report, layout, report_path)


def _gather_to_file(obj: Any, layout: RankLayout, path: Path) -> None:
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, obj)
    if layout.rank == 0:
        torch.save(gathered, path)


def _batch(seed: int, update: int, dp_size: int) -> torch.Tensor:
    """The global batch (2 * D, SEQ_LEN + 1) of update `update`: random token ids, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 10_000 + update)
    return torch.randint(0, model_config().vocab_size, (2 * dp_size, SEQ_LEN + 1), generator=gen)


def _rank_checkpoint(model: Any, optimizer: torch.optim.Optimizer, spec: RealRunSpec, layout: RankLayout,
                     losses: list[float]) -> dict[str, Any]:
    """Upstream's `state_dict()`, through `move_to_cpu`, then `extra_state.update(...)` as `save_checkpoint` does."""
    state = {
        "cfg": upstream_cfg(model_config(spec.model_parallel_size), rank=layout.rank,
                            world_size=spec.world_size * spec.model_parallel_size,
                            model_parallel_size=spec.model_parallel_size, seed=spec.seed, lr=LR, seq_len=SEQ_LEN,
                            streaming=spec.streaming, ema=spec.ema, fp16_adam_stats=spec.fp16_adam_stats),
        "model": _fp16(model.local_state_dict()),
        "criterion": None,
        "optimizer_history": _optimizer_history(spec),
        "task_state": {},
        "extra_state": {"metrics": _metrics(losses, layout.rank), "previous_training_time": 61.5 + layout.rank,
                        "ewm_loss": float(losses[-1])},
        "last_optimizer_state": upstream_optimizer_state(optimizer.state_dict(), fp16_adam_stats=spec.fp16_adam_stats),
        "shard_metadata": model.local_metadata_dict(),
    }
    if spec.ema:
        ema = _ema_local_state(spec, layout)
        state["extra_state"].update(ema=_fp16(ema), ema_fp32_params={k: v.float() for k, v in ema.items()})
    state = _move_to_cpu(state)
    state["extra_state"].update(train_iterator=train_iterator_state(spec, layout.rank), val_loss=float(losses[0]))
    if spec.model_parallel_size > 1:
        state["extra_state"]["rng_tracker_states"] = _rng_tracker_states(spec, layout)
    return state


def _move_to_cpu(x: Any) -> Any:
    """metaseq's `utils.move_to_cpu(cast_to_fp32=False)`: dicts become dicts, tuples (and so
    `torch.Size`) plain tuples, lists lists; other objects (Namespace) are kept as they are."""
    if torch.is_tensor(x):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _move_to_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_move_to_cpu(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_move_to_cpu(v) for v in x)
    return x


def _fp16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().half() if v.is_floating_point() else v.detach().clone() for k, v in state.items()}


def _ema_local_state(spec: RealRunSpec, layout: RankLayout) -> dict[str, torch.Tensor]:
    """This rank's local state of a second model (another seed), flattened and padded by the same FSDP."""
    ema_model = build_fsdp_model(model_config(spec.model_parallel_size), seed=spec.seed + EMA_SEED_OFFSET,
                                 device=torch.device("cpu"), layout=layout)
    lazy_init_all(ema_model)
    return {k: v.detach().clone() for k, v in ema_model.local_state_dict().items()}


def upstream_optimizer_state(osd: dict[str, Any], *, fp16_adam_stats: bool) -> dict[str, Any]:
    """torch's (sharded, flat) AdamW state dict in the form metaseq's FusedAdamV1 +
    MemoryEfficientFP16Optimizer save: int steps, fp32 (or scaled fp16) moments, `loss_scale`."""
    state = {}
    for k, s in osd["state"].items():
        entry = {"step": int(s["step"]), "exp_avg": s["exp_avg"].float().clone(),
                 "exp_avg_sq": s["exp_avg_sq"].float().clone()}
        state[k] = _fp16_stats(entry) if fp16_adam_stats else entry
    groups = [{"lr": g["lr"], "bias_correction": True, "betas": tuple(g["betas"]), "eps": g["eps"],
               "weight_decay": g["weight_decay"], "max_grad_norm": 0.0, "params": list(g["params"])}
              for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups, "loss_scale": LOSS_SCALE}


def _fp16_stats(entry: dict[str, Any]) -> dict[str, Any]:
    """FusedAdamV1 with `use_fp16_stats`: moment v stored as (v / scale).half(), scale = 1e-8 + max|v| / 65504."""
    scales = {}
    for name in ("exp_avg", "exp_avg_sq"):
        v = entry[name]
        scales[f"{name}_scale"] = 1e-8 + torch.linalg.vector_norm(v, float("inf")) / FP16_MAX  # 0-dim fp32
        entry[name] = (v / scales[f"{name}_scale"]).half()
    return {**entry, **scales}


def _optimizer_history(spec: RealRunSpec) -> list[dict[str, Any]]:
    """One entry per (re)start; the last describes the run that wrote the file."""
    criterion = "VocabParallelCrossEntropyCriterion" if spec.model_parallel_size > 1 else "CrossEntropyCriterion"
    return [{"criterion_name": criterion, "optimizer_name": "MemoryEfficientFP16Optimizer",
             "lr_scheduler_state": {"best": None}, "num_updates": n}
            for n in (spec.updates // 2, spec.updates)]


def _metrics(losses: list[float], rank: int) -> dict[str, list[tuple[int, str, str, dict[str, Any]]]]:
    """metaseq's `metrics.state_dict()`: per aggregator, (priority, name, meter class, meter state) tuples."""
    loss = torch.tensor(losses[-1])  # 0-dim, as the criterion logs it
    average = {"val": loss, "sum": loss * 4, "count": 4, "round": 3}
    train = [(0, "loss", "AverageMeter", average),
             (800, "train_wall", "StopwatchMeter", {"sum": 12.5 + rank, "n": len(losses), "round": 0}),
             (1000, "wps", "TimeMeter", {"init": 0, "start": 1000.0, "n": 48 * len(losses), "round": 1})]
    return {"default": [], "train": train, "train_inner": [(0, "loss", "AverageMeter", dict(average))]}


def _rng_tracker_states(spec: RealRunSpec, layout: RankLayout) -> dict[str, torch.Tensor]:
    """fairscale's `get_cuda_rng_tracker().get_states()`: a CUDA Philox state (int64 seed, int64
    offset) as 16 uint8 bytes. Upstream's differ per model part; these per rank, so a test can tell
    whose were kept."""
    philox = torch.tensor([spec.seed + 2718 + layout.mp_rank, 4 * spec.updates + layout.dp_rank], dtype=torch.int64)
    return {"model-parallel-rng": philox.view(torch.uint8).clone()}


def train_iterator_state(spec: RealRunSpec, rank: int) -> dict[str, Any]:
    """Upstream's iterator state of global rank `rank` after `spec.updates` updates (see the module docstring)."""
    if not spec.streaming:
        return {"version": 2, "epoch": 1, "iterations_in_epoch": spec.updates, "shuffle": True}
    # Batch n came from loader worker n % LOADER_WORKERS: 2 sequences on each of the W data-parallel ranks.
    per_worker = [len(range(w, spec.updates, LOADER_WORKERS)) * 2 * spec.world_size for w in range(LOADER_WORKERS)]
    cache = expected_tokenization_cache(spec.seed) if rank == 0 else None
    return {"epoch": 1, "sequences_consumed": per_worker, "tokenization_cache": cache, "n": spec.updates}


def expected_tokenization_cache(seed: int) -> LockingArray:
    """Rank 0's `tokenization_cache` of a streaming run with `seed`: token counts of `NUM_DOCUMENTS`
    documents (0: not tokenized yet), `LOADER_WORKERS` workers."""
    lengths = np.random.default_rng(seed).integers(0, 2048, NUM_DOCUMENTS)
    lengths[::7] = 0
    return LockingArray(lengths, num_workers=LOADER_WORKERS)


def _unflattened_params(model: Any) -> dict[str, torch.Tensor]:
    """FSDP's full `state_dict()` (collective), as upstream's `convert_to_singleton` keeps it: parameters
    only, under their original names, fp16, the tied output projection dropped."""
    clean = lambda name: name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")  # noqa: E731
    buffers = {clean(name) for name, _ in model.named_buffers()}
    full = {clean(k): v.detach().clone().half() for k, v in model.state_dict().items()}
    return {k: v for k, v in full.items() if k not in buffers and k != TIED}


def write_restored(path: str | Path, params: dict[str, torch.Tensor], shard0: dict[str, Any]) -> Path:
    """Write upstream's consolidated `restored.pt`: `params` (unflattened), the cfg of rank 0's
    checkpoint dict `shard0` as an omegaconf `DictConfig` (needs omegaconf, the test extra), and
    shard0's other keys without the optimizer state, the FSDP metadata and the flat EMA shards."""
    from omegaconf import OmegaConf

    cfg = copy.deepcopy(shard0["cfg"])
    cfg["model"].arch = "transformer_lm"  # convert_to_singleton renames the arch
    config = OmegaConf.create(cfg, flags={"allow_objects": True})  # Namespace values, as upstream's loader allows
    OmegaConf.set_struct(config, True)
    out = {k: v for k, v in shard0.items() if k not in ("last_optimizer_state", "shard_metadata")}
    out.update(cfg=config, model=params,
               extra_state={k: v for k, v in shard0["extra_state"].items() if k not in EMA_KEYS})
    with upstream_classes():
        torch.save(out, path)
    return Path(path)


def reload_in_fsdp(paths: list[Path], *, world_size: int, model_parallel_size: int = 1,
                   out_path: str | Path) -> list[dict[str, Any]]:
    """Load each file into a fresh real FSDP model built from its own cfg (`load_local_state_dict`,
    fp16 cast to fp32) and return, per global rank, what fairscale then reports: {"metadata":
    `local_metadata_dict()` (torch.Size shapes), "model": `local_state_dict()`}. `paths` as
    `real_run_paths` orders them (e.g. a reshard's outputs, W = their number); rank 0 saves the
    list to `out_path`."""
    by_rank = [str(paths[mp * world_size + dp]) for dp in range(world_size) for mp in range(model_parallel_size)]
    run_on_mp_ranks(_reload_on_rank, world_size * model_parallel_size, model_parallel_size, by_rank, str(out_path))
    return torch.load(out_path, weights_only=True)


def _reload_on_rank(layout: RankLayout, files: list[str], out_path: str) -> None:
    _gather_to_file(_reload_report(layout, Path(files[layout.rank])), layout, Path(out_path))


def _reload_report(layout: RankLayout, path: Path) -> dict[str, Any]:
    ckpt = load_real(path)
    model = build_fsdp_model(ModelConfig.from_dict(ckpt["cfg"]["model"]), seed=0, device=torch.device("cpu"),
                             layout=layout)
    lazy_init_all(model)
    model.load_local_state_dict({k: v.float() for k, v in ckpt["model"].items()})
    return {"metadata": model.local_metadata_dict(),
            "model": {k: v.detach().clone() for k, v in model.local_state_dict().items()}}
