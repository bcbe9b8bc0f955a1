"""Train the small OPT-style LM with fairscale FSDP and write raw sharded checkpoints.

Example (4 ranks on CPU/gloo, or one GPU per rank with NCCL when CUDA exists):

    python -m metaseq.cli.train --data docs/demo_corpus.txt --save-dir ckpts \\
        --world-size 4 --max-update 20 --save-interval-updates 10 --batch-size 8

Every rank writes `checkpoint_{n}-model_part-0-shard{rank}.pt` and
`checkpoint_last-model_part-0-shard{rank}.pt`. The loss does not depend on the
world size: an update's global batch is the same sequences for any W.
"""
from __future__ import annotations

import argparse
import copy
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
import torch.multiprocessing as mp
import torch.nn.functional as F

from metaseq import checkpoint_utils
from metaseq.data import LineDataset, load_lines
from metaseq.distributed.fsdp import init_distributed, lazy_init_all, wrap_model_fsdp
from metaseq.file_io import CheckpointLoadError, load_checkpoint
from metaseq.models.transformer_lm import ModelConfig, build_model
from metaseq.tokenizer import PAD

logger = logging.getLogger("metaseq.cli.train")


@dataclass
class TrainConfig:
    data: str
    save_dir: str
    world_size: int = 1
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
    p.add_argument("--data", required=True, help="plain-text file, one training example per line")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--world-size", type=int, default=d.world_size, help="FSDP ranks to spawn")
    p.add_argument("--max-update", type=int, default=d.max_update)
    p.add_argument("--save-interval-updates", type=int, default=d.save_interval_updates, help="0: only at the end")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="GLOBAL sequences per update")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--restore-file",
        default=None,
        help="DIR/checkpoint_last.pt (loads its W shard files) or a consolidated file such as reshard-model_part-0.pt",
    )
    p.add_argument("--log-format", choices=["json", "simple"], default=d.log_format)
    p.add_argument("--decoder-layers", type=int, default=m.decoder_layers)
    p.add_argument("--decoder-embed-dim", type=int, default=m.decoder_embed_dim)
    p.add_argument("--decoder-attention-heads", type=int, default=m.decoder_attention_heads)
    p.add_argument("--decoder-ffn-embed-dim", type=int, default=m.decoder_ffn_embed_dim)
    p.add_argument("--max-target-positions", type=int, default=m.max_target_positions)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    model = ModelConfig(
        decoder_layers=args.decoder_layers,
        decoder_embed_dim=args.decoder_embed_dim,
        decoder_attention_heads=args.decoder_attention_heads,
        decoder_ffn_embed_dim=args.decoder_ffn_embed_dim,
        max_target_positions=args.max_target_positions,
    )
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    return TrainConfig(model=model, **{k: v for k, v in vars(args).items() if k in names})


def validate_config(cfg: TrainConfig) -> None:
    """Raise ValueError naming the flag to change."""
    if cfg.world_size < 1:
        raise ValueError(f"--world-size={cfg.world_size} must be at least 1")
    if cfg.batch_size % cfg.world_size:
        raise ValueError(
            f"--batch-size={cfg.batch_size} is not divisible by --world-size={cfg.world_size}; "
            "the global batch is split evenly across ranks"
        )
    if cfg.seq_len > cfg.model.max_target_positions:
        raise ValueError(
            f"--seq-len={cfg.seq_len} exceeds --max-target-positions={cfg.model.max_target_positions}"
        )
    if not os.path.isfile(cfg.data):
        raise ValueError(f"--data {cfg.data}: no such file")
    cfg.model.validate()
    if cfg.restore_file:
        checkpoint_utils.find_restore_files(cfg.restore_file, cfg.world_size)


def checkpoint_cfg(cfg: TrainConfig, model_cfg: ModelConfig, rank: int) -> dict[str, Any]:
    """The config saved in every checkpoint, as plain builtins (safe to load)."""
    return {
        "model": model_cfg.to_dict(),
        "distributed_training": {
            "distributed_world_size": cfg.world_size,
            "distributed_rank": rank,
            "ddp_backend": "fully_sharded",
            "use_sharded_state": True,
        },
        "optimization": {"lr": [cfg.lr], "max_update": cfg.max_update, "batch_size": cfg.batch_size},
        "task": {"data": cfg.data, "seq_len": cfg.seq_len},
        "common": {"seed": cfg.seed},
    }


def restore(cfg: TrainConfig, rank: int) -> tuple[dict[str, Any] | None, ModelConfig]:
    """This rank's restore checkpoint (or None) and the model config to build."""
    if not cfg.restore_file:
        return None, cfg.model
    path = checkpoint_utils.find_restore_files(cfg.restore_file, cfg.world_size)[rank]
    ckpt = load_checkpoint(path)
    return ckpt, ModelConfig.from_dict(ckpt["cfg"]["model"])


def load_restored_state(model: Any, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> TrainState:
    """Load shards (flat, this rank's) or a consolidated checkpoint (unflattened, any W)."""
    lazy_init_all(model)
    osd = ckpt.get("last_optimizer_state")
    if any(key.endswith("flat_param_0") for key in ckpt["model"]):
        model.load_local_state_dict(ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])
        if osd is not None:
            # fairscale's consolidated optimizer layout -> this rank's flat shard.
            osd = model.get_shard_from_optim_state_dict(copy.deepcopy(osd))
    if osd is None:
        logger.warning("the restored checkpoint has no optimizer state; Adam starts from scratch")
    else:
        optimizer.load_state_dict(osd)
    extra = ckpt.get("extra_state") or {}
    return TrainState(
        num_updates=(ckpt.get("optimizer_history") or [{}])[-1].get("num_updates", 0),
        samples_seen=(extra.get("train_iterator") or {}).get("samples_seen", 0),
        training_time=extra.get("previous_training_time", 0.0),
    )


def train_step(model: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor, rank: int, world_size: int, device: torch.device) -> float:
    """One update on this rank's slice of the global batch (B, T+1); returns the global mean loss."""
    per_rank = batch.size(0) // world_size
    local = batch[rank * per_rank : (rank + 1) * per_rank].to(device)
    inputs, targets = local[:, :-1], local[:, 1:]  # (b, T)
    global_tokens = int((batch[:, 1:] != PAD).sum())
    logits = model(inputs)  # (b, T, V)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum")
    # FSDP averages gradients over ranks, so scale by W to get the global token mean.
    (loss_sum * world_size / global_tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss_sum.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / global_tokens


def log_update(cfg: TrainConfig, state: TrainState, loss: float) -> None:
    record = {
        "num_updates": state.num_updates,
        "loss": loss,
        "world_size": cfg.world_size,
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
    configure_logging()  # a spawned rank is a fresh interpreter
    device = init_distributed(rank, cfg.world_size, init_method)
    try:
        run_training(rank, cfg, device)
    finally:
        dist.destroy_process_group()


def run_training(rank: int, cfg: TrainConfig, device: torch.device) -> None:
    ckpt, model_cfg = restore(cfg, rank)
    model = wrap_model_fsdp(build_model(model_cfg, seed=cfg.seed), device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    state = load_restored_state(model, optimizer, ckpt) if ckpt else TrainState()
    del ckpt
    data = LineDataset(load_lines(cfg.data), cfg.seq_len, cfg.seed)
    start, loss = time.perf_counter() - state.training_time, float("nan")
    while state.num_updates < cfg.max_update:
        batch = data.global_batch(state.samples_seen, cfg.batch_size)
        loss = train_step(model, optimizer, batch, rank, cfg.world_size, device)
        state.num_updates += 1
        state.samples_seen += cfg.batch_size
        state.training_time = time.perf_counter() - start
        if rank == 0:
            log_update(cfg, state, loss)
        interval = cfg.save_interval_updates
        if state.num_updates == cfg.max_update or (interval and state.num_updates % interval == 0):
            save(model, optimizer, cfg, model_cfg, state, rank, loss)


def save(model: Any, optimizer: torch.optim.Optimizer, cfg: TrainConfig, model_cfg: ModelConfig,
         state: TrainState, rank: int, loss: float) -> None:
    ckpt = checkpoint_utils.build_training_checkpoint(
        model,
        optimizer,
        num_updates=state.num_updates,
        train_iterator={"samples_seen": state.samples_seen},
        cfg=checkpoint_cfg(cfg, model_cfg, rank),
        metrics={"loss": loss},
        training_time=state.training_time,
    )
    paths = checkpoint_utils.save_training_checkpoint(ckpt, cfg.save_dir, rank=rank, num_updates=state.num_updates)
    if rank == 0:
        logger.info("saved %s (and the other ranks' shards)", paths[0])


def launch(cfg: TrainConfig) -> None:
    """Spawn `cfg.world_size` ranks that rendezvous through a file in a temp dir."""
    os.makedirs(cfg.save_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="metaseq-rdzv-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(train_worker, args=(cfg, init_method), nprocs=cfg.world_size, join=True)


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
