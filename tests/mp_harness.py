"""Model-parallel test helpers: train at any (P, W), and look inside model-parallel checkpoints on real ranks.

Real fairscale (FSDP and its tensor-parallel layers) on CPU/gloo, `file://` rendezvous in a
temp dir. For the model-parallel resharding tests:

    from mp_harness import FIXED_TOKENS, compute_logits, gather_full_state, run_train_mp

    run_train_mp(d, model_parallel_size=2, world_size=4, max_update=4)   # 2 parts x 2 shards
    full = gather_full_state(d / "checkpoint_last.pt", model_parallel_size=2, out_path=tmp / "full.pt")
    full["model"]["decoder.layers.0.fc1.weight"]      # (76, 30): merged across parts, unflattened
    full["exp_avg"]["decoder.layers.0.fc1.weight"]    # Adam's first moment, the same shape
    logits = compute_logits(d / "checkpoint_last.pt", FIXED_TOKENS, model_parallel_size=2,
                            out_path=tmp / "logits.pt")                 # (B, T, V), all parts' vocabulary

A `source` is what `--restore-file` takes, resolved by `checkpoint_utils.find_restore_files`:
- a stem `DIR/checkpoint_last.pt`: flat shards `DIR/checkpoint_last-model_part-{j}-shard{i}.pt`,
  one per rank; the world size defaults to their number;
- one consolidated per-part file `DIR/reshard-model_part-{j}.pt` (unflattened, fairscale's
  consolidated optimizer layout, as `reshard_fsdp --unflatten-weights` writes per part):
  every part's file is found; the world size defaults to P (give more for D > 1);
- or an explicit list of files, one per global rank (rank = dp_rank * P + mp_rank).

On every rank the file is loaded into the real FSDP model-parallel model (the plain model
at P = 1) with `load_local_state_dict` (flat) or `load_state_dict` +
`get_shard_from_optim_state_dict` (consolidated), and the optimizer with `load_state_dict`.
Full tensors come from FSDP itself (`state_dict()`, which all-gathers over the data-parallel
group and unflattens); the parts are merged with `metaseq.models.partition.merge_state_dicts`.
"""
from __future__ import annotations

import glob
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import get_model_parallel_group
from fairscale.nn.model_parallel.mappings import gather_from_model_parallel_region

from metaseq.checkpoint_utils import find_restore_files, is_consolidated_file, load_training_state
from metaseq.distributed.fsdp import fsdp_instances, init_distributed, start_ranks
from metaseq.distributed.model_parallel import RankLayout, build_fsdp_model, init_model_parallel, shutdown_model_parallel
from metaseq.file_io import load_checkpoint, shard_glob
from metaseq.models.partition import merge_state_dicts
from metaseq.models.transformer_lm import ModelConfig
from metaseq.tokenizer import encode
from training import run_train

__all__ = [
    "FIXED_TOKENS",
    "MOMENTS",
    "MP_MODEL_FLAGS",
    "compute_logits",
    "gather_full_state",
    "inspect_checkpoint",
    "load_mp_checkpoint",
    "rank_files",
    "run_on_mp_ranks",
    "run_train_mp",
]

# Sizes P = 1 and 2 both divide: 2 heads of 15, FFN 76 (38 per part, so a layer's flat
# parameter has an odd length and 2 data-parallel ranks pad it), vocabulary 260.
MP_MODEL_FLAGS = ["--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "76"]
MOMENTS = ("exp_avg", "exp_avg_sq")
# (2, 12) token ids: two corpus-like prompts, cut to the same length.
FIXED_TOKENS = torch.tensor([encode("what is the meaning")[:12], encode("the cat sat on a mat")[:12]])


def run_train_mp(save_dir: Path, *, model_parallel_size: int, world_size: int, max_update: int,
                 fused_qkv: bool = False, extra: Sequence[str] = (), check: bool = True) -> subprocess.CompletedProcess:
    """`python -m metaseq.cli.train` at (P, W) with `MP_MODEL_FLAGS`: the same model and losses for every P."""
    return run_train(save_dir, world_size=world_size, max_update=max_update, extra=[*MP_MODEL_FLAGS, *extra],
                     check=check, model_parallel_size=model_parallel_size, fused_qkv=fused_qkv)


def rank_files(source: str | Path | Sequence[str | Path], *, model_parallel_size: int,
               world_size: int | None = None) -> list[str]:
    """The file each global rank loads (see the module docstring for what `source` may be)."""
    if isinstance(source, (list, tuple)):
        return [str(f) for f in source]
    source = str(source)
    if world_size is None and is_consolidated_file(source):
        world_size = model_parallel_size
    elif world_size is None:
        world_size = len(glob.glob(shard_glob(source, "*")))
    return find_restore_files(source, world_size, model_parallel_size)


def run_on_mp_ranks(fn: Callable[..., None], world_size: int, model_parallel_size: int, *args: Any) -> None:
    """Call `fn(layout, *args)` on every rank, with fairscale's model-parallel groups set up; `fn` must be importable."""
    with tempfile.TemporaryDirectory(prefix="mp-test-") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        start_ranks(_entry, (world_size, model_parallel_size, init_method, fn, args), world_size)


def _entry(rank: int, world_size: int, model_parallel_size: int, init_method: str, fn: Callable[..., None],
           args: tuple) -> None:
    init_distributed(rank, world_size, init_method)
    layout = RankLayout(rank, world_size, model_parallel_size)
    try:
        init_model_parallel(layout, seed=1)
        fn(layout, *args)
    finally:
        shutdown_model_parallel(layout)
        dist.destroy_process_group()


def load_mp_checkpoint(layout: RankLayout, path: str) -> tuple[Any, torch.optim.Optimizer, dict[str, Any]]:
    """On a rank: (FSDP model, Adam, checkpoint) with this rank's file loaded, as training restores it."""
    ckpt = load_checkpoint(path)
    model = build_fsdp_model(ModelConfig.from_dict(ckpt["cfg"]["model"]), seed=0, device=torch.device("cpu"),
                             layout=layout)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0)  # lr and moments come from the file
    load_training_state(model, optimizer, ckpt)
    return model, optimizer, ckpt


def inspect_checkpoint(source: str | Path | Sequence[str | Path], *, model_parallel_size: int, out_path: str | Path,
                       world_size: int | None = None, tokens: torch.Tensor | None = None) -> dict[str, Any]:
    """Load `source` on real ranks; the root saves to `out_path`, and this returns:

    `model`, `exp_avg`, `exp_avg_sq`: {plain parameter name: full tensor} (buffers only in
    `model`; the tied `decoder.output_projection.weight` listed like the plain model's
    `state_dict()` does); `step`: Adam's step; `cfg_model`: the files' `cfg["model"]`; and with
    `tokens` (B, T), `logits`: the model's (B, T, V) logits, gathered over the parts.
    """
    files = rank_files(source, model_parallel_size=model_parallel_size, world_size=world_size)
    run_on_mp_ranks(_inspect_on_rank, len(files), model_parallel_size, files, str(out_path), tokens)
    return torch.load(out_path, weights_only=True)


def gather_full_state(source: str | Path | Sequence[str | Path], *, model_parallel_size: int, out_path: str | Path,
                      world_size: int | None = None) -> dict[str, Any]:
    """Merged, unflattened parameters and Adam moments of a model-parallel checkpoint (see `inspect_checkpoint`)."""
    return inspect_checkpoint(source, model_parallel_size=model_parallel_size, out_path=out_path, world_size=world_size)


def compute_logits(source: str | Path | Sequence[str | Path], tokens: torch.Tensor, *, model_parallel_size: int,
                   out_path: str | Path, world_size: int | None = None) -> torch.Tensor:
    """(B, T, V) logits of `tokens` (B, T) from the checkpoint, computed by the FSDP model-parallel model."""
    return inspect_checkpoint(source, model_parallel_size=model_parallel_size, out_path=out_path,
                              world_size=world_size, tokens=tokens)["logits"]


def _inspect_on_rank(layout: RankLayout, files: list[str], out_path: str, tokens: torch.Tensor | None) -> None:
    model, optimizer, ckpt = load_mp_checkpoint(layout, files[layout.rank])
    part = _full_part_state(model, optimizer)
    logits = _full_logits(model, tokens, layout) if tokens is not None else None
    if layout.model_parallel_size > 1:
        parts: list[Any] = [None] * layout.model_parallel_size
        dist.all_gather_object(parts, part, group=get_model_parallel_group())
        part = {key: merge_state_dicts([p[key] for p in parts]) for key in part}
    if layout.rank == 0:
        flat = next(iter(optimizer.state.values()))
        result = {**part, "step": int(flat["step"]), "cfg_model": ckpt["cfg"]["model"], "logits": logits}
        torch.save(result, out_path)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")


def _full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """FSDP's own full state dict of this part (all-gathered over the data-parallel ranks, unflattened)."""
    return {_clean(k): v.detach().clone() for k, v in model.state_dict().items()}


def _full_part_state(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """This part's full parameters, and each Adam moment unflattened by FSDP the same way.

    A moment is laid out (and padded) exactly like its flat parameter shard, so it is put in
    the shard's place for one `state_dict()` call, then the weights are put back. (fairscale
    0.4.13's `gather_full_optim_state_dict` cannot be used with P > 1: it passes group ranks
    where `broadcast_object_list` wants global ones, "Global rank 1 is not part of group".)
    """
    out = {"model": _full_state_dict(model)}
    buffers = {_clean(name) for name, _ in model.named_buffers()}
    flats = [p for instance in fsdp_instances(model) for p in instance.params]
    weights = [p.data.clone() for p in flats]
    for key in MOMENTS:
        with torch.no_grad():
            for p in flats:
                p.data.copy_(optimizer.state[p][key])
        out[key] = {k: v for k, v in _full_state_dict(model).items() if k not in buffers}
    with torch.no_grad():
        for p, w in zip(flats, weights):
            p.data.copy_(w)
    return out


@torch.no_grad()
def _full_logits(model: Any, tokens: torch.Tensor, layout: RankLayout) -> torch.Tensor:
    logits = model(tokens)  # (B, T, V/P) on every rank
    if layout.model_parallel_size > 1:
        logits = gather_from_model_parallel_region(logits)  # (B, T, V): parts in order
    return logits.clone()
