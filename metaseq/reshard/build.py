"""Build output shards from analyzed inputs (pure: inputs come from a `fetch(rank)` callable).

    source = analyze_shards(shards, labels, options)     # validate everything first
    out = build_output_shard(source, options, r, fetch)  # one output rank at a time

`consolidate_shards` and `reshard_shards` do both in memory for callers that already
hold the shard dicts (e.g. an inference loader).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from metaseq.reshard.layout import ModelLayout, analyze_model, output_metadata
from metaseq.reshard.optim import (
    OPTIM,
    OptimLayout,
    analyze_optimizer,
    assemble_consolidated_optimizer,
    assemble_flat_optimizer,
    consolidated_optimizer_targets,
    flat_optimizer_targets,
)
from metaseq.reshard.ranges import Allocate, Piece, Target, materialize_targets, plan_range, shard_range
from metaseq.reshard.schema import ReshardError
from metaseq.torchzip import Size

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPES",
    "ReshardOptions",
    "ReshardSource",
    "analyze_shards",
    "assemble_output_shard",
    "build_output_shard",
    "consolidate_shards",
    "make_options",
    "plan_targets",
    "reshard_shards",
]

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --output-dtype: torch dtype names
Fetch = Callable[[int], Mapping[str, Any]]


@dataclass(frozen=True)
class ReshardOptions:
    num_output_shards: int = 1
    unflatten: bool = False
    skip_optimizer_state: bool = False
    output_dtype: torch.dtype | None = None  # floating model weights and buffers only
    drop_metaseq_req: bool = False


@dataclass(frozen=True)
class ReshardSource:
    model: ModelLayout
    optim: OptimLayout | None  # None: no optimizer state to reshard (absent, None or skipped)


def make_options(
    *,
    num_output_shards: int = 1,
    unflatten: bool = False,
    skip_optimizer_state: bool = False,
    output_dtype: str | None = None,
    drop_metaseq_req: bool = False,
) -> ReshardOptions:
    """Validate user options; errors name the CLI flag to change."""
    if not isinstance(num_output_shards, int) or num_output_shards < 1:
        raise ReshardError(f"--num-output-shards={num_output_shards}: must be at least 1")
    if unflatten and num_output_shards != 1:
        raise ReshardError(
            f"--unflatten-weights needs --num-output-shards=1 (got {num_output_shards}); "
            "original parameters cannot be sharded, drop one of the two flags"
        )
    if output_dtype is not None and output_dtype not in DTYPES:
        raise ReshardError(f"--output-dtype={output_dtype}: expected one of {', '.join(DTYPES)}")
    dtype = None
    if output_dtype is not None:
        import torch  # only casting needs torch's dtypes

        dtype = getattr(torch, DTYPES[output_dtype])
    return ReshardOptions(num_output_shards, unflatten, skip_optimizer_state, dtype, drop_metaseq_req)


def analyze_shards(
    shards: Sequence[Mapping[str, Any]], labels: Sequence[str], options: ReshardOptions
) -> ReshardSource:
    """Validate the inputs (ordered by rank) against each other and the options; no tensor data is read."""
    if not shards:
        raise ReshardError("no input shards")
    model = analyze_model(shards, labels)
    optim = None if options.skip_optimizer_state else analyze_optimizer(shards, model)
    if optim is not None and options.unflatten and optim.num_param_groups != 1:
        raise ReshardError(
            f"{labels[0]}: {OPTIM} has {optim.num_param_groups} param groups but fairscale's consolidated "
            "layout (--unflatten-weights) supports one; pass --skip-optimizer-state"
        )
    extra_state = shards[0].get("extra_state")
    if options.drop_metaseq_req and extra_state is not None and not isinstance(extra_state, Mapping):
        raise ReshardError(f"{labels[0]}: extra_state is a {type(extra_state).__name__}, not a dict; drop --drop-metaseq-req")
    return ReshardSource(model, optim)


def plan_targets(source: ReshardSource, options: ReshardOptions, rank: int) -> list[Target]:
    """Every tensor of output shard `rank`: its shape, dtype and the input pieces to copy."""
    model, targets = source.model, []
    for k, fp in enumerate(model.flat_params):
        dtype = _cast(model.dtypes[k], options.output_dtype)
        if options.unflatten:
            for name, shape, (start, end) in zip(fp.names, fp.shapes, fp.ranges()):
                targets.append(Target(("model", name), shape, dtype, plan_range(model.sources[k], start, end)))
        else:
            start, end, padded_len = shard_range(fp.numel, options.num_output_shards, rank)
            pieces = plan_range(model.sources[k], start, end)
            targets.append(Target(("model", fp.key), Size([padded_len]), dtype, pieces))
    for extra in model.extras:  # buffers: copied (compact) from rank 0
        if extra.shape is not None:
            n = extra.shape.numel()
            pieces = (Piece(0, ("model", extra.actual_key), 0, 0, n),) if n else ()
            targets.append(Target(("model", extra.key), extra.shape, _cast(extra.dtype, options.output_dtype), pieces))
    if source.optim is not None and options.unflatten:
        targets += consolidated_optimizer_targets(source.optim, model)
    elif source.optim is not None:
        targets += flat_optimizer_targets(source.optim, model, options.num_output_shards, rank)
    return targets


def _cast(dtype: torch.dtype, output_dtype: torch.dtype | None) -> torch.dtype:
    return output_dtype if output_dtype is not None and dtype.is_floating_point else dtype


def build_output_shard(
    source: ReshardSource,
    options: ReshardOptions,
    rank: int,
    fetch: Fetch,
    *,
    allocate: Allocate | None = None,
    on_copied: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Output shard `rank`: fresh, compact tensors; every other top-level key from input rank 0.

    `fetch(r)` returns input r's dict; it is called once per input that holds a needed
    piece, in rank order, plus once more for rank 0's carried keys. Every tensor comes
    from `allocate` (see `materialize_targets`); `on_copied(nbytes)` reports progress.
    """
    targets = plan_targets(source, options, rank)
    tensors = materialize_targets(targets, fetch, allocate=allocate, on_copied=on_copied)
    return assemble_output_shard(source, options, rank, fetch(0), tensors)


def assemble_output_shard(
    source: ReshardSource, options: ReshardOptions, rank: int, shard0: Mapping[str, Any], tensors: dict
) -> dict[str, Any]:
    """Output shard `rank` around `tensors` (target path -> tensor); other keys from input rank 0's `shard0`."""
    out: dict[str, Any] = {}
    for key, value in shard0.items():
        if key == "model":
            out[key] = _assemble_model(source.model, options, value, tensors)
        elif key == "shard_metadata":
            out[key] = output_metadata(source.model, _paddings(source.model, options, rank))
        elif key == OPTIM and options.skip_optimizer_state:
            continue
        elif key == OPTIM and source.optim is not None:
            out[key] = _assemble_optimizer(source, options, rank, value, tensors)
        elif key == "extra_state" and options.drop_metaseq_req and value is not None:
            out[key] = {**value, "train_iterator": None}
        else:
            out[key] = value
    if options.drop_metaseq_req and out.get("extra_state") is None:
        out["extra_state"] = {"train_iterator": None}
    return out


def _assemble_model(
    model: ModelLayout, options: ReshardOptions, model0: Mapping[str, Any], tensors: dict
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fp in model.flat_params:
        for key in fp.names if options.unflatten else (fp.key,):
            out[key] = tensors[("model", key)]
    if options.unflatten:
        for src, dst in model.ties:  # the same tensor: saved once, loaded as a tie
            out[dst] = out[src]
    for extra in model.extras:
        out[extra.key] = tensors[("model", extra.key)] if extra.shape is not None else model0[extra.actual_key]
    return out


def _paddings(model: ModelLayout, options: ReshardOptions, rank: int) -> list[int]:
    if options.unflatten:
        return [0] * len(model.flat_params)
    paddings = []
    for fp in model.flat_params:
        start, end, padded_len = shard_range(fp.numel, options.num_output_shards, rank)
        paddings.append(padded_len - (end - start))
    return paddings


def _assemble_optimizer(
    source: ReshardSource, options: ReshardOptions, rank: int, osd0: Mapping[str, Any], tensors: dict
) -> dict[str, Any]:
    if options.unflatten:
        return assemble_consolidated_optimizer(osd0, source.optim, source.model, tensors)
    return assemble_flat_optimizer(osd0, source.optim, source.model, tensors, rank)


def reshard_shards(
    shard_dicts: Sequence[Mapping[str, Any]],
    *,
    num_output_shards: int = 1,
    unflatten_weights: bool = False,
    skip_optimizer_state: bool = False,
    output_dtype: str | None = None,
    drop_metaseq_req: bool = False,
) -> list[dict[str, Any]]:
    """In-memory N -> M reshard of shard dicts ordered by rank; inputs are not modified.

    Non-tensor entries (cfg, extra_state, ...) are shared with shard_dicts[0], not copied.
    """
    options = make_options(
        num_output_shards=num_output_shards,
        unflatten=unflatten_weights,
        skip_optimizer_state=skip_optimizer_state,
        output_dtype=output_dtype,
        drop_metaseq_req=drop_metaseq_req,
    )
    labels = [f"shard {r}" for r in range(len(shard_dicts))]
    source = analyze_shards(shard_dicts, labels, options)
    return [build_output_shard(source, options, r, shard_dicts.__getitem__) for r in range(num_output_shards)]


def consolidate_shards(
    shard_dicts: list[dict], *, unflatten: bool = True, skip_optimizer_state: bool = True
) -> dict:
    """One consolidated checkpoint dict from all shards of one model part (ordered by rank).

    With `unflatten`, `model` holds original parameter names and shapes (tied
    parameters included, sharing one tensor) plus buffers, ready for a non-FSDP model.
    """
    return reshard_shards(shard_dicts, unflatten_weights=unflatten, skip_optimizer_state=skip_optimizer_state)[0]
