"""Train the small OPT-style LM with fairscale FSDP and write raw sharded checkpoints.

Example (4 ranks on CPU/gloo, or one GPU per rank with NCCL when CUDA exists):

    python -m metaseq.cli.train --data docs/demo_corpus.txt --save-dir ckpts \\
        --world-size 4 --max-update 20 --save-interval-updates 10 --batch-size 8

Every rank writes `checkpoint_{n}-model_part-0-shard{rank}.pt` and
`checkpoint_last-model_part-0-shard{rank}.pt`. The loss does not depend on the
world size: an update's global batch is the same sequences for any W.

With `--model-parallel-size P` (tensor parallelism with fairscale's model-parallel
layers, `metaseq.models.model_parallel`) the W ranks hold P model parts, each
FSDP-sharded over D = W / P ranks; global rank r = dp_rank * P + mp_rank writes
`checkpoint_{n}-model_part-{mp_rank}-shard{dp_rank}.pt`. The model and the losses
do not depend on P or D (up to summation order).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from metaseq import checkpoint_utils
from metaseq.data import LineDataset, load_lines
from metaseq.distributed.fsdp import init_distributed, start_ranks
from metaseq.distributed.model_parallel import (
    RankLayout,
    build_fsdp_model,
    data_parallel_group,
    init_model_parallel,
    shutdown_model_parallel,
)
from metaseq.file_io import CheckpointLoadError, load_checkpoint, summarize_paths
from metaseq.models.model_parallel import check_model_parallel_sizes, vocab_parallel_loss_sum
from metaseq.models.transformer_lm import ModelConfig
from metaseq.tokenizer import PAD

logger = logging.getLogger("metaseq.cli.train")


@dataclass
class TrainConfig:
    data: str
    save_dir: str
    world_size: int = 1
    model_parallel_size: int = 1
    max_update: int = 10
    save_interval_updates: int = 0  # 0: save only at the end
    batch_size: int = 8  # GLOBAL sequences per update
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 1
    restore_file: str | None = None
    log_format: str = "json"
    model: ModelConfig = field(default_factory=ModelConfig)


@dataclass
class TrainState:
    num_updates: int = 0
    samples_seen: int = 0
    training_time: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m metaseq.cli.train",
        description="Train the small OPT-style LM with fairscale FSDP, writing raw sharded checkpoints.",
        epilog="example: python -m metaseq.cli.train --data corpus.txt --save-dir ckpts --world-size 4 --max-update 20",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d, m = TrainConfig, ModelConfig
    p.add_argument("--data", required=True, type=os.path.expanduser, help="plain-text file, one training example per line")
    p.add_argument("--save-dir", required=True, type=os.path.expanduser)  # a quoted '~' too
    p.add_argument("--world-size", type=int, default=d.world_size, help="ranks to start on this machine (a multiple of --model-parallel-size)")
    p.add_argument(
        "--model-parallel-size", type=int, default=d.model_parallel_size,
        help="tensor model-parallel parts P; each is FSDP-sharded over --world-size / P ranks",
    )
    p.add_argument("--max-update", type=int, default=d.max_update)
    p.add_argument("--save-interval-updates", type=int, default=d.save_interval_updates, help="0: only at the end")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="GLOBAL sequences per update")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--restore-file",
        default=None,
        type=os.path.expanduser,
        help="DIR/checkpoint_last.pt (loads its shard files, P parts x W/P shards) or a consolidated file such as "
        "reshard-model_part-0.pt (with P > 1, one of its per-part files)",
    )
    p.add_argument("--log-format", choices=["json", "simple"], default=d.log_format)
    p.add_argument("--decoder-layers", type=int, default=m.decoder_layers)
    p.add_argument("--decoder-embed-dim", type=int, default=m.decoder_embed_dim)
    p.add_argument("--decoder-attention-heads", type=int, default=m.decoder_attention_heads)
    p.add_argument("--decoder-ffn-embed-dim", type=int, default=m.decoder_ffn_embed_dim)
    p.add_argument("--max-target-positions", type=int, default=m.max_target_positions)
    p.add_argument("--fused-qkv", action="store_true", help="one qkv_proj per attention layer instead of q/k/v_proj")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    model = ModelConfig(
        decoder_layers=args.decoder_layers,
        decoder_embed_dim=args.decoder_embed_dim,
        decoder_attention_heads=args.decoder_attention_heads,
        decoder_ffn_embed_dim=args.decoder_ffn_embed_dim,
        max_target_positions=args.max_target_positions,
        fused_qkv=args.fused_qkv,
    )
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    return TrainConfig(model=model, **{k: v for k, v in vars(args).items() if k in names})


def validate_config(cfg: TrainConfig) -> None:
    """Raise ValueError naming the flag to change."""
    if cfg.world_size < 1:
        raise ValueError(f"--world-size={cfg.world_size} must be at least 1")
    validate_parallel_sizes(cfg)
    if cfg.seq_len > cfg.model.max_target_positions:
        raise ValueError(
            f"--seq-len={cfg.seq_len} exceeds --max-target-positions={cfg.model.max_target_positions}"
        )
    if not os.path.isfile(cfg.data):
        raise ValueError(f"--data {cfg.data}: no such file")
    cfg.model.validate()
    if cfg.restore_file:
        checkpoint_utils.find_restore_files(cfg.restore_file, cfg.world_size, cfg.model_parallel_size)
    else:  # a restored model's sizes come from its files
        check_model_parallel_sizes(cfg.model, cfg.model_parallel_size)


def validate_parallel_sizes(cfg: TrainConfig) -> None:
    """W a multiple of P, and the global batch split evenly over the D = W / P data-parallel ranks."""
    mp, world = cfg.model_parallel_size, cfg.world_size
    if mp < 1:
        raise ValueError(f"--model-parallel-size={mp} must be at least 1")
    if world % mp:
        raise ValueError(
            f"--world-size={world} is not a multiple of --model-parallel-size={mp}; "
            f"use --world-size={max(mp, world - world % mp)} or another multiple of {mp}"
        )
    if mp == 1 and cfg.batch_size % world:
        raise ValueError(
            f"--batch-size={cfg.batch_size} is not divisible by --world-size={world}; "
            "the global batch is split evenly across ranks"
        )
    if cfg.batch_size % (world // mp):
        raise ValueError(
            f"--batch-size={cfg.batch_size} is not divisible by the data-parallel size {world // mp} "
            f"(--world-size={world} / --model-parallel-size={mp}); the global batch is split evenly across "
            "data-parallel ranks"
        )


def checkpoint_cfg(cfg: TrainConfig, model_cfg: ModelConfig, layout: RankLayout) -> dict[str, Any]:
    """The config saved in every checkpoint, as plain builtins (safe to load); metaseq's keys."""
    return {
        "model": model_cfg.to_dict(),
        "distributed_training": {
            "distributed_world_size": cfg.world_size,
            "distributed_rank": layout.rank,
            "ddp_backend": "fully_sharded",
            "use_sharded_state": True,
        },
        "optimization": {"lr": [cfg.lr], "max_update": cfg.max_update, "batch_size": cfg.batch_size},
        "task": {"data": cfg.data, "seq_len": cfg.seq_len},
        "common": {"seed": cfg.seed, "model_parallel_size": cfg.model_parallel_size},
    }


def restore(cfg: TrainConfig, rank: int) -> tuple[dict[str, Any] | None, ModelConfig]:
    """This rank's restore checkpoint (or None) and the model config to build."""
    if not cfg.restore_file:
        return None, cfg.model
    path = checkpoint_utils.find_restore_files(cfg.restore_file, cfg.world_size, cfg.model_parallel_size)[rank]
    ckpt = load_checkpoint(path)
    return ckpt, ModelConfig.from_dict(ckpt["cfg"]["model"])


def load_restored_state(model: Any, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> TrainState:
    """Load shards (flat, this rank's) or a consolidated checkpoint of this rank's part (unflattened, any D)."""
    checkpoint_utils.load_training_state(model, optimizer, ckpt)
    extra = ckpt.get("extra_state") or {}
    return TrainState(
        num_updates=(ckpt.get("optimizer_history") or [{}])[-1].get("num_updates", 0),
        samples_seen=(extra.get("train_iterator") or {}).get("samples_seen", 0),
        training_time=extra.get("previous_training_time", 0.0),
    )


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor, layout: RankLayout,
               device: torch.device) -> float:
    """One update on this data-parallel rank's slice of the global batch (B, T+1); returns the global mean loss.

    The P model parts of one replica see the same slice.
    """
    per_rank = batch.size(0) // layout.dp_size
    local = batch[layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank].to(device)
    inputs, targets = local[:, :-1], local[:, 1:]  # (b, T)
    global_tokens = int((batch[:, 1:] != PAD).sum())
    logits = model(inputs)  # (b, T, V), or (b, T, V/P) with model parallelism
    if layout.model_parallel_size == 1:
        loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum")
    else:
        loss_sum = vocab_parallel_loss_sum(logits, targets, ignore_index=PAD)
    # FSDP averages gradients over the D data-parallel ranks, so scale by D to get the global token mean.
    (loss_sum * layout.dp_size / global_tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss_sum.detach().clone()
    if layout.dp_size > 1:
        dist.all_reduce(total, group=data_parallel_group(layout))
    return float(total) / global_tokens


def log_update(cfg: TrainConfig, state: TrainState, loss: float) -> None:
    record = {
        "num_updates": state.num_updates,
        "loss": loss,
        "world_size": cfg.world_size,
        "model_parallel_size": cfg.model_parallel_size,
        "lr": cfg.lr,
        "samples_seen": state.samples_seen,
        "wall": round(state.training_time, 3),
    }
    if cfg.log_format == "json":
        line = json.dumps(record)
    else:
        line = f"update {state.num_updates:5d} | loss {loss:.5f} | world_size {cfg.world_size}"
    print(line, flush=True)


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", stream=sys.stderr
    )


def train_worker(rank: int, cfg: TrainConfig, init_method: str) -> None:
    configure_logging()  # a spawned rank (with CUDA) is a fresh interpreter
    device = init_distributed(rank, cfg.world_size, init_method)
    layout = RankLayout(rank, cfg.world_size, cfg.model_parallel_size)
    try:
        init_model_parallel(layout, cfg.seed)
        run_training(layout, cfg, device)
    finally:
        shutdown_model_parallel(layout)
        dist.destroy_process_group()


def run_training(layout: RankLayout, cfg: TrainConfig, device: torch.device) -> None:
    ckpt, model_cfg = restore(cfg, layout.rank)
    model = build_fsdp_model(model_cfg, seed=cfg.seed, device=device, layout=layout)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    state = load_restored_state(model, optimizer, ckpt) if ckpt else TrainState()
    del ckpt
    data = LineDataset(load_lines(cfg.data), cfg.seq_len, cfg.seed)
    start, loss = time.perf_counter() - state.training_time, float("nan")
    while state.num_updates < cfg.max_update:
        batch = data.global_batch(state.samples_seen, cfg.batch_size)
        loss = train_step(model, optimizer, batch, layout, device)
        state.num_updates += 1
        state.samples_seen += cfg.batch_size
        state.training_time = time.perf_counter() - start
        if layout.rank == 0:
            log_update(cfg, state, loss)
        interval = cfg.save_interval_updates
        if state.num_updates == cfg.max_update or (interval and state.num_updates % interval == 0):
            save(model, optimizer, cfg, model_cfg, state, layout, loss)


def save(model: Any, optimizer: torch.optim.Optimizer, cfg: TrainConfig, model_cfg: ModelConfig,
         state: TrainState, layout: RankLayout, loss: float) -> None:
    ckpt = checkpoint_utils.build_training_checkpoint(
        model,
        optimizer,
        num_updates=state.num_updates,
        train_iterator={"samples_seen": state.samples_seen},
        cfg=checkpoint_cfg(cfg, model_cfg, layout),
        metrics={"loss": loss},
        training_time=state.training_time,
    )
    paths = checkpoint_utils.save_training_checkpoint(
        ckpt, cfg.save_dir, rank=layout.dp_rank, num_updates=state.num_updates, model_part=layout.mp_rank
    )
    if layout.rank == 0:
        logger.info("saved %s (and the other ranks' shards)", paths[0])
        removed = checkpoint_utils.remove_replaced_shards(cfg.save_dir, state.num_updates, cfg.model_parallel_size,
                                                          cfg.world_size // cfg.model_parallel_size)
        if removed:
            logger.warning("removed %s: shards of an earlier run with more ranks, which this save replaces",
                           summarize_paths(removed))


def launch(cfg: TrainConfig) -> None:
    """Start `cfg.world_size` ranks that rendezvous through a file in a temp dir."""
    os.makedirs(cfg.save_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metaseq-rdzv-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        start_ranks(train_worker, (cfg, init_method), cfg.world_size)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    cfg = config_from_args(build_parser().parse_args(argv))
    try:
        validate_config(cfg)
    except (ValueError, CheckpointLoadError) as e:
        logger.error("%s", e)
        return 2
    launch(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
