"""Train the small OPT-style LM with fairscale FSDP and write raw sharded checkpoints.

Example (4 ranks on CPU/gloo, or one GPU per rank with NCCL when CUDA exists):

    python -m metaseq.cli.train --data metaseq/assets/qa_corpus.txt --save-dir ckpts \\
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
import builtins
import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from metaseq import checkpoint_utils
from metaseq.cli_logging import (
    OneLineErrorParser, Terminated, non_negative_float, non_negative_int, positive_int, sigterm_raises,
)
from metaseq.cli_start import run_as_main
from metaseq.data import LineDataset, load_lines
from metaseq.distributed.fsdp import init_distributed, start_ranks
from metaseq.distributed.model_parallel import (
    RankLayout,
    build_fsdp_model,
    data_parallel_group,
    init_model_parallel,
    shutdown_model_parallel,
)
from metaseq.errors import UserError, short_repr
from metaseq.file_io import load_checkpoint, remove_stale_temp_files_in, summarize_paths
from metaseq.models.model_parallel import check_model_parallel_sizes, vocab_parallel_loss_sum
from metaseq.models.transformer_lm import ModelConfig, weights_mismatch
from metaseq.reshard.schema import cfg_value
from metaseq.tokenizer import PAD, VOCAB_SIZE
from metaseq.torchzip import signals_held

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
    trust_checkpoint: bool = False  # let torch.load run the classes in --restore-file's files
    log_format: str = "json"
    model: ModelConfig = field(default_factory=ModelConfig)  # with restore_file, the restored model's
    restored_updates: int = 0  # the update restore_file was saved at
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # in every save: files of two runs do not mix


@dataclass
class TrainState:
    num_updates: int = 0
    samples_seen: int = 0
    training_time: float = 0.0


# A flag left out takes, with --restore-file, the restored run's value (so that a resumed run goes on as it was):
# TrainConfig field -> where the checkpoint's cfg holds it (`checkpoint_cfg`). A restored model's sizes come from
# its files.
MAX_SEED = 2**46 - 1  # seed * 100003 + epoch must fit torch's 64-bit seed
RESTORED = {"seed": ("common", "seed", non_negative_int), "lr": ("optimization", "lr", non_negative_float),
            "batch_size": ("optimization", "batch_size", positive_int), "seq_len": ("task", "seq_len", positive_int)}
MODEL_FLAGS = ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads", "decoder_ffn_embed_dim",
               "max_target_positions", "fused_qkv")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m metaseq.cli.train",
        description="Train the small OPT-style LM with fairscale FSDP, writing raw sharded checkpoints.",
        epilog="example: python -m metaseq.cli.train --data corpus.txt --save-dir ckpts --world-size 4 --max-update 20",
    )
    d, m = TrainConfig, ModelConfig

    def run_flag(name: str, kind: Any, default: Any, text: str) -> None:  # None: the restored run's, or the default
        p.add_argument(name, type=kind, default=None, help=f"{text} (default: {default}, or the restored run's)")

    def model_flag(name: str, default: int) -> None:
        p.add_argument(name, type=positive_int, default=None,
                       help=f"default: {default}, or with --restore-file the restored model's (a value given must "
                       "agree)")

    p.add_argument("--data", required=True, type=os.path.expanduser,
                   help="plain-text file, one training example per line")
    p.add_argument("--save-dir", required=True, type=os.path.expanduser,
                   help="folder for the checkpoints (made if needed)")
    p.add_argument("--world-size", type=positive_int, default=d.world_size,
                   help=f"ranks to start on this machine, a multiple of --model-parallel-size (default: "
                   f"{d.world_size})")
    p.add_argument("--model-parallel-size", type=positive_int, default=d.model_parallel_size,
                   help="tensor model-parallel parts P; each is FSDP-sharded over --world-size / P ranks (default: 1)")
    p.add_argument("--max-update", type=positive_int, default=d.max_update,
                   help=f"train until this update, counting the restored run's (default: {d.max_update})")
    p.add_argument("--save-interval-updates", type=non_negative_int, default=d.save_interval_updates,
                   help="also save every N updates (default: 0, only at the end)")
    run_flag("--batch-size", positive_int, d.batch_size, "GLOBAL sequences per update")
    run_flag("--seq-len", positive_int, d.seq_len, "tokens per sequence")
    run_flag("--lr", non_negative_float, d.lr, "Adam's learning rate")
    run_flag("--seed", int, d.seed, "random seed of the initial weights and the data order")
    p.add_argument(
        "--restore-file",
        default=None,
        type=os.path.expanduser,
        help="DIR/checkpoint_last.pt (loads its shard files, P parts x W/P shards) or a consolidated file such as "
        "reshard-model_part-0.pt (with P > 1, one of its per-part files)",
    )
    p.add_argument("--trust-checkpoint", action="store_true", default=False,
                   help="let torch.load run the classes in --restore-file's files (only for files you trust: it can "
                   "run any code); without it only tensors, builtins and argparse.Namespace are unpickled")
    p.add_argument("--log-format", choices=["json", "simple"], default=d.log_format, help="default: json")
    model_flag("--decoder-layers", m.decoder_layers)
    model_flag("--decoder-embed-dim", m.decoder_embed_dim)
    model_flag("--decoder-attention-heads", m.decoder_attention_heads)
    model_flag("--decoder-ffn-embed-dim", m.decoder_ffn_embed_dim)
    model_flag("--max-target-positions", m.max_target_positions)
    p.add_argument("--fused-qkv", action="store_true", default=None,
                   help="one qkv_proj per attention layer instead of q/k/v_proj")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The flags given; those left out from the restored run (see RESTORED) or their defaults."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    model_flags = {k: given.pop(k) for k in MODEL_FLAGS if k in given}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if not args.restore_file:
        return TrainConfig(model=ModelConfig(**model_flags), **{k: v for k, v in given.items() if k in fields})
    check_world_size(args.world_size, args.model_parallel_size)
    restored = checkpoint_utils.read_restore_files(args.restore_file, args.world_size, args.model_parallel_size,
                                                   trust=args.trust_checkpoint)
    try:
        model = ModelConfig.from_dict(restored.model_cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--restore-file {args.restore_file}: cfg['model'] does not describe this model "
                         f"({e})") from None
    for name, value in model_flags.items():
        if value != getattr(model, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}={value} but the restored model has {name}={getattr(model, name)}: a restored "
                             f"model's sizes come from its files; drop {flag}")
    check_restored_weights(args.restore_file, model, restored.shapes)
    if restored.samples_seen is None and restored.num_updates:
        logger.warning("--restore-file %s holds no data position (extra_state['train_iterator'] has no samples_seen: "
                       "upstream metaseq's, or dropped by reshard_fsdp --drop-metaseq-req): training starts the data "
                       "from its beginning, not where update %d left it", args.restore_file, restored.num_updates)
    values = {k: v for k, v in given.items() if k in fields}
    limits = {"seed": (MAX_SEED, str(MAX_SEED)),
              "seq_len": (model.max_target_positions, f"the model's max_target_positions={model.max_target_positions}")}
    for name, (section, key, check) in RESTORED.items():
        value = cfg_value(restored.cfg, section, key)
        value = value[0] if isinstance(value, list) and value else value  # lr: one per param group
        if value is None or name in values:
            continue
        limit, most = limits.get(name, (math.inf, ""))
        try:  # checked as the flag is
            if type(value) not in ((int, float) if check is non_negative_float else (int,)):
                wanted = "a number" if check is non_negative_float else "an integer"
                raise argparse.ArgumentTypeError(f"must be {wanted}, got {short_repr(value, 40)}")
            values[name] = check(str(value))
            if values[name] > limit:
                raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--restore-file {args.restore_file}: its cfg['{section}']['{key}'] {e}; pass "
                             f"--{name.replace('_', '-')} to give another") from None
    return TrainConfig(model=model, restored_updates=restored.num_updates, **values)


def check_restored_weights(restore_file: str, model: ModelConfig, shapes: Mapping[str, Sequence[int]]) -> None:
    """The files' parameters must be those of the model their cfg['model'] describes (names and whole shapes), and
    its vocabulary must hold the byte tokenizer's ids that --data becomes; a larger one is trained on those ids."""
    if problem := weights_mismatch(model, shapes, whole_state=False):
        raise ValueError(f"--restore-file {restore_file}: {problem}; its cfg['model'] does not describe its weights "
                         "(edited?): restore files training wrote")
    if model.vocab_size < VOCAB_SIZE:
        raise ValueError(f"--restore-file {restore_file}: the model has {model.vocab_size} tokens, fewer than the "
                         f"{VOCAB_SIZE} ids of the byte tokenizer that --data is read with; restore a model of this "
                         "project's vocabulary")
    if model.vocab_size > VOCAB_SIZE:
        logger.warning("--restore-file %s: the model has %d tokens (another tokenizer's, e.g. OPT's GPT-2 BPE) but "
                       "--data is read with the byte tokenizer's %d ids, which it is trained on", restore_file,
                       model.vocab_size, VOCAB_SIZE)


def validate_config(cfg: TrainConfig) -> None:
    """Raise ValueError naming the flag to change."""
    validate_parallel_sizes(cfg)
    if cfg.seq_len > cfg.model.max_target_positions:
        where = "the restored model's max_target_positions=" if cfg.restore_file else "--max-target-positions="
        raise ValueError(f"--seq-len={cfg.seq_len} exceeds {where}{cfg.model.max_target_positions}; "
                         "pass a smaller --seq-len")
    if not 0 <= cfg.seed <= MAX_SEED:  # the data order seeds torch with seed * 100003 + epoch
        raise ValueError(f"--seed={cfg.seed}: give a seed from 0 to {MAX_SEED}")
    if os.path.exists(cfg.data) and not os.path.isfile(cfg.data) and not os.path.isdir(cfg.data):
        raise ValueError(f"--data {cfg.data} is a pipe or device, which every rank reads again; save it to a file "
                         "and pass that")
    try:
        if not load_lines(cfg.data):
            raise ValueError(f"--data {cfg.data}: the file has no non-empty lines; give one example per line")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--data {cfg.data}: cannot read it as UTF-8 text ({getattr(e, 'strerror', None) or e})")
    cfg.model.validate()
    if cfg.restore_file and cfg.max_update <= cfg.restored_updates:
        raise ValueError(f"--max-update={cfg.max_update} but --restore-file {cfg.restore_file} was saved at update "
                         f"{cfg.restored_updates}: nothing to train; pass a --max-update above {cfg.restored_updates}")
    if not cfg.restore_file:  # a restored model's sizes come from its files
        check_model_parallel_sizes(cfg.model, cfg.model_parallel_size)
    if os.path.exists(cfg.save_dir) and not os.path.isdir(cfg.save_dir):
        raise ValueError(f"--save-dir {cfg.save_dir} is a file; give a folder for the checkpoints")


def check_world_size(world: int, mp: int) -> None:
    if world % mp:
        raise ValueError(
            f"--world-size={world} is not a multiple of --model-parallel-size={mp}; "
            f"use --world-size={max(mp, world - world % mp)} or another multiple of {mp}"
        )


def validate_parallel_sizes(cfg: TrainConfig) -> None:
    """W a multiple of P, and the global batch split evenly over the D = W / P data-parallel ranks."""
    mp, world = cfg.model_parallel_size, cfg.world_size
    check_world_size(world, mp)
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


def restore(cfg: TrainConfig, rank: int) -> dict[str, Any] | None:
    """This rank's restore checkpoint, or None."""
    if not cfg.restore_file:
        return None
    path = checkpoint_utils.find_restore_files(cfg.restore_file, cfg.world_size, cfg.model_parallel_size)[rank]
    return load_checkpoint(path, trust=cfg.trust_checkpoint)


def load_restored_state(model: Any, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> TrainState:
    """Load shards (flat, this rank's) or a consolidated checkpoint of this rank's part (unflattened, any D)."""
    checkpoint_utils.load_training_state(model, optimizer, ckpt)
    updates, samples, time = checkpoint_utils.saved_progress(ckpt)  # checked before the ranks started
    return TrainState(num_updates=updates or 0, samples_seen=samples or 0, training_time=time or 0.0)


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
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked one has the launcher's (`sigterm_raises`)
    device = init_distributed(rank, cfg.world_size, init_method)
    layout = RankLayout(rank, cfg.world_size, cfg.model_parallel_size)
    try:
        init_model_parallel(layout, cfg.seed)
        run_training(layout, cfg, device)
    finally:
        shutdown_model_parallel(layout)
        dist.destroy_process_group()


def run_training(layout: RankLayout, cfg: TrainConfig, device: torch.device) -> None:
    ckpt, model_cfg = restore(cfg, layout.rank), cfg.model
    model = build_fsdp_model(model_cfg, seed=cfg.seed, device=device, layout=layout)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    state = load_restored_state(model, optimizer, ckpt) if ckpt else TrainState()
    for group in optimizer.param_groups:  # --lr, not the restored state's, from now on
        group["lr"] = cfg.lr
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
        run_id=cfg.run_id,
    )
    paths = checkpoint_utils.save_training_checkpoint(
        ckpt, cfg.save_dir, rank=layout.dp_rank, num_updates=state.num_updates, model_part=layout.mp_rank,
        wait=dist.barrier,  # every rank's numbered file written before any checkpoint_last is replaced
    )
    dist.barrier()
    if layout.rank == 0:
        logger.info("saved %s (and the other ranks' shards)", paths[0])
        removed = checkpoint_utils.remove_replaced_shards(cfg.save_dir, state.num_updates, cfg.model_parallel_size,
                                                          cfg.world_size // cfg.model_parallel_size)
        if removed:
            logger.warning("removed %s: files of an earlier save under these names, with more shards or model parts, "
                           "which this save replaces", summarize_paths(removed))


def launch(cfg: TrainConfig) -> None:
    """Start `cfg.world_size` ranks that rendezvous through a file in a temp dir."""
    with tempfile.TemporaryDirectory(prefix="metaseq-rdzv-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        try:
            start_ranks(train_worker, (cfg, init_method), cfg.world_size)
        finally:
            with signals_held():  # ranks stopped while saving leave their temp files (their pids are gone now)
                remove_stale_temp_files_in(cfg.save_dir)


def make_save_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--save-dir {path}: cannot make the folder ({e.strerror or e}); give another") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--save-dir {path}: no permission to write there; give another folder")


RESUME_HINT = "the last complete save is the one to --restore-file"
_OS_ERRORS = "|".join(name for name, c in vars(builtins).items() if isinstance(c, type) and issubclass(c, OSError))
_USER_ERROR_PREFIX = rf"^(({_OS_ERRORS}): (\[Errno \d+\] )?|metaseq\.[\w.]+: )"  # a rank's error, as traceback ends


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    try:
        cfg = config_from_args(build_parser().parse_args(argv))
        validate_config(cfg)
        make_save_dir(cfg.save_dir)  # only once all is checked: a refused run leaves nothing behind
    except (ValueError, UserError) as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    try:
        with sigterm_raises():  # the rendezvous folder is removed, and the ranks stop with this process
            launch(cfg)
    except mp.ProcessRaisedException as e:  # the rank's traceback, as text: its last line is the error
        error = str(e).strip().splitlines()[-1]  # as one_line_error reports it: ours and OSErrors by their message
        logger.error("rank %d failed: %s", e.error_index, re.sub(_USER_ERROR_PREFIX, "", error))
        return 2
    except mp.ProcessExitedException as e:  # killed (e.g. out of memory) or exited without a Python error
        logger.error("rank %d %s", e.error_index, str(e).split(" ", 2)[-1])
        return 2
    except Terminated:
        logger.error("terminated by SIGTERM; %s", RESUME_HINT)
        return 2
    except KeyboardInterrupt:
        logger.error("interrupted; %s", RESUME_HINT)
        return 130
    return 0


if __name__ == "__main__":
    run_as_main(main)
