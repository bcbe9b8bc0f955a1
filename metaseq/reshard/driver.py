"""File-level resharding: find the input shards, plan, then write one output shard at a time.

Memory: planning loads each input with mmap and keeps only a skeleton (tensors on
the meta device), so no tensor data is read. Writing (`metaseq.reshard.parallel`)
builds one output shard at a time per process, mmap-opening only the inputs it
needs; peak memory is about one output shard per process plus the pages being copied.
"""
from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from metaseq.file_io import load_checkpoint, natural_sort_key, skeleton
from metaseq.reshard.build import ReshardOptions, ReshardSource, analyze_shards, make_options, plan_targets
from metaseq.reshard.direct import DirectInput, check_direct_sources, read_direct_inputs
from metaseq.reshard.parallel import list_jobs, write_jobs
from metaseq.reshard.progress import Progress
from metaseq.reshard.schema import ReshardError
from metaseq.torchzip import Unsupported

if TYPE_CHECKING:
    from metaseq.reshard.locate import LocatedFile

__all__ = [
    "ReshardPlan",
    "describe_reshard_plan",
    "find_input_shards",
    "output_shard_paths",
    "plan_reshard_fsdp",
    "reshard_fsdp_checkpoints",
    "summarize_plan",
    "write_reshard_outputs",
]

logger = logging.getLogger(__name__)

_SHARD_RE = re.compile(r"shard(\d+)")
_PART_RE = re.compile(r"model_part-(\d+)")


@dataclass(frozen=True)
class ReshardPlan:
    inputs: tuple[str, ...]  # ordered by shard index
    outputs: tuple[str, ...]
    source: ReshardSource
    options: ReshardOptions
    trust_checkpoint: bool
    located: tuple[LocatedFile | None, ...] = ()  # per input: tensor offsets, so writing skips unpickling
    direct: tuple[DirectInput, ...] = ()  # per input, when read without torch: written without torch too


def _last_int(pattern: re.Pattern, path: str) -> int | None:
    found = pattern.findall(os.path.basename(path))
    return int(found[-1]) if found else None


def find_input_shards(input_glob_pattern: str) -> list[str]:
    """Files matching the pattern, ordered by shard index; they must be shards 0..N-1 of one model part."""
    paths = sorted(glob.glob(input_glob_pattern), key=natural_sort_key)
    paths = [p for p in paths if os.path.isfile(p)]
    if not paths:
        raise ReshardError(f"--input-glob-pattern {input_glob_pattern!r} matches no files")
    parts = {_last_int(_PART_RE, p) for p in paths}
    if len(parts) > 1:
        raise ReshardError(
            f"inputs mix model parts {sorted(parts, key=str)} ({_few(paths)}); reshard one model part "
            "at a time, e.g. --input-glob-pattern '...-model_part-0-shard*.pt', or every part with '{j}' "
            "in both names: '...-model_part-{j}-shard*.pt' and '...-model_part-{j}-shard{i}.pt'"
        )
    indices = [_last_int(_SHARD_RE, p) for p in paths]
    if len(paths) == 1 and indices[0] is None:
        return paths  # a single (consolidated) file
    if None in indices:
        raise ReshardError(f"{paths[indices.index(None)]}: no shard index ('shardK') in its name; cannot order the inputs")
    _check_indices(paths, indices)
    return [p for _, p in sorted(zip(indices, paths))]


def _check_indices(paths: Sequence[str], indices: Sequence[int]) -> None:
    seen: dict[int, str] = {}
    for path, idx in zip(paths, indices):
        if idx in seen:
            raise ReshardError(f"shard index {idx} appears twice: {seen[idx]} and {path}")
        seen[idx] = path
    missing = sorted(set(range(len(paths))) - set(seen))
    if missing:
        raise ReshardError(
            f"shard{missing[0]} is missing: found {len(paths)} shard files ({_few(list(paths))}) "
            f"but shard indices must be exactly 0..{len(paths) - 1}; check --input-glob-pattern"
        )


def _few(paths: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f", ... ({len(paths)} files)" if len(paths) > limit else "")


def output_shard_paths(
    output_shard_name: str, num_output_shards: int, inputs: Sequence[str], *, overwrite: bool
) -> list[str]:
    """`{i}` in the name becomes the output shard index; refuse clobbering inputs or (without overwrite) files."""
    if num_output_shards > 1 and "{i}" not in output_shard_name:
        raise ReshardError(
            f"--num-output-shards={num_output_shards} but --output-shard-name {output_shard_name!r} has no "
            "'{i}'; add it where the shard index goes, e.g. 'out/reshard-model_part-0-shard{i}.pt'"
        )
    outputs = [output_shard_name.replace("{i}", str(i)) for i in range(num_output_shards)]
    real_inputs = {os.path.realpath(p) for p in inputs}
    for path in outputs:
        if os.path.realpath(path) in real_inputs:
            raise ReshardError(f"--output-shard-name: {path} is also an input; write to another name")
        if os.path.isdir(path):
            raise ReshardError(f"--output-shard-name: {path} is a directory; give a file name")
    existing = [p for p in outputs if os.path.exists(p)]
    if existing and not overwrite:
        raise ReshardError(f"{_few(existing)} already exist(s); pass --overwrite to replace")
    return outputs


def _load_skeleton(path: str, trust: bool) -> tuple[dict[str, Any], LocatedFile | None]:
    from metaseq.reshard.locate import locate_tensors  # imports torch

    shard = load_checkpoint(path, mmap=True, trust=trust)
    return skeleton(shard), locate_tensors(shard, path)


def plan_reshard_fsdp(
    input_glob_pattern: str,
    output_shard_name: str,
    *,
    num_output_shards: int = 1,
    unflatten_weights: bool = False,
    skip_optimizer_state: bool = False,
    output_dtype: str | None = None,
    drop_metaseq_req: bool = False,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    direct: bool = True,
) -> ReshardPlan:
    """Find and validate everything (names, metadata, lengths, optimizer state) without writing.

    With `direct` (and no dtype cast), inputs whose pickles hold only the checkpoint format's
    types are read and later written without torch (`metaseq.reshard.direct`); the plan is
    the same either way.
    """
    options = make_options(
        num_output_shards=num_output_shards,
        unflatten=unflatten_weights,
        skip_optimizer_state=skip_optimizer_state,
        output_dtype=output_dtype,
        drop_metaseq_req=drop_metaseq_req,
    )
    inputs = find_input_shards(input_glob_pattern)
    logger.info("found %d input shard(s) matching %r", len(inputs), input_glob_pattern)
    outputs = output_shard_paths(output_shard_name, num_output_shards, inputs, overwrite=overwrite)
    if direct and options.output_dtype is None:
        plan = _plan_direct(inputs, outputs, options, trust_checkpoint)
        if plan is not None:
            return plan
    skeletons, located = zip(*(_load_skeleton(p, trust_checkpoint) for p in inputs))
    source = analyze_shards(skeletons, inputs, options)
    return ReshardPlan(tuple(inputs), tuple(outputs), source, options, trust_checkpoint, located)


def _plan_direct(
    inputs: Sequence[str], outputs: Sequence[str], options: ReshardOptions, trust_checkpoint: bool
) -> ReshardPlan | None:
    """The plan from pickles read without torch, or None when some input or piece needs torch."""
    direct = read_direct_inputs(inputs)
    if direct is None:
        return None
    source = analyze_shards([d.structure for d in direct], inputs, options)
    try:
        check_direct_sources(source, options, direct)
    except Unsupported as e:
        logger.info("reading and writing through torch, which is slower: %s", e)
        return None
    return ReshardPlan(tuple(inputs), tuple(outputs), source, options, trust_checkpoint, direct=tuple(direct))


def write_reshard_outputs(
    plan: ReshardPlan, *, num_workers: int = 1, progress: Progress | None = None, checksums: bool = False
) -> list[str]:
    """Write every output shard atomically, with `num_workers` processes (see `metaseq.reshard.parallel`).

    On any failure the outputs this call wrote are removed. `checksums`: store zip CRC32s.
    """
    logger.info("resharding %s", summarize_plan(plan))
    return write_jobs([plan], list_jobs([plan]), num_workers=num_workers, progress=progress, checksums=checksums)


def summarize_plan(plan: ReshardPlan) -> str:
    """`8 shard(s) -> 2 flat shard(s); optimizer state kept; dtype unchanged; bytes copied directly`."""
    opts = plan.options
    form = "unflattened" if opts.unflatten else "flat"
    src = "1 unflattened input" if plan.source.model.unflattened else f"{len(plan.inputs)} shard(s)"
    optim = "dropped" if opts.skip_optimizer_state else ("kept" if plan.source.optim else "none")
    dtype = str(opts.output_dtype).replace("torch.", "") if opts.output_dtype else "unchanged"
    how = "bytes copied directly" if plan.direct else "through torch"
    return f"{src} -> {opts.num_output_shards} {form} shard(s); optimizer state {optim}; dtype {dtype}; {how}"


def describe_reshard_plan(plan: ReshardPlan) -> list[str]:
    """Human-readable plan: inputs, N -> M, per output its tensor bytes and the input ranges it reads."""
    lines = [f"inputs ({len(plan.inputs)}):"] + [f"  {path}" for path in plan.inputs]
    lines.append(f"plan: {summarize_plan(plan)}")
    for rank, path in enumerate(plan.outputs):
        targets = plan_targets(plan.source, plan.options, rank)
        nbytes = sum(t.nbytes for t in targets)
        lines.append(f"output {rank}: {path} ({nbytes} bytes of tensors)")
        lines += [f"  reads {plan.inputs[r]}: {text}" for r, text in _reads(targets).items()]
    return lines


def _reads(targets: Sequence[Any], limit: int = 4) -> dict[int, str]:
    """Per input rank: the model tensors and [start, end) element ranges read from them."""
    spans: dict[int, dict[str, list[int]]] = {}
    for t in targets:
        for p in t.pieces:
            if p.path[0] != "model":
                continue
            span = spans.setdefault(p.rank, {}).setdefault(p.path[-1], [p.src_start, p.src_start + p.length])
            span[0], span[1] = min(span[0], p.src_start), max(span[1], p.src_start + p.length)
    out = {}
    for rank in sorted(spans):
        items = [f"{key}[{lo}:{hi})" for key, (lo, hi) in spans[rank].items()]
        more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
        out[rank] = ", ".join(items[:limit]) + more
    return out


def reshard_fsdp_checkpoints(
    input_glob_pattern: str,
    output_shard_name: str,
    *,
    num_output_shards: int = 1,
    unflatten_weights: bool = False,
    skip_optimizer_state: bool = False,
    output_dtype: str | None = None,
    drop_metaseq_req: bool = False,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
    dry_run: bool = False,
    verify: bool = False,
    num_workers: int = 1,
    direct: bool = True,
) -> list[str]:
    """Reshard the FSDP shards of one model part into `num_output_shards` files; returns their paths.

    Example: 4 training shards -> one inference file with original parameter names:
        reshard_fsdp_checkpoints("ckpts/checkpoint_last-model_part-0-shard*.pt",
                                 "out/reshard-model_part-0.pt",
                                 unflatten_weights=True, skip_optimizer_state=True)
    With `dry_run`, the plan is logged and nothing is written (the paths are still returned).
    With `verify`, every input byte is checked against its zip CRC32 before writing and the
    outputs are compared with the inputs afterwards (see `metaseq.reshard.verify`), and the
    outputs get zip CRC32s too. `num_workers` > 1 writes outputs in parallel. `direct=False` reads
    and writes with torch even where the bytes could be copied directly (see `plan_reshard_fsdp`).
    Raises ReshardError (or CheckpointLoadError) before writing anything when inputs or options are wrong.
    """
    plan = plan_reshard_fsdp(
        input_glob_pattern,
        output_shard_name,
        num_output_shards=num_output_shards,
        unflatten_weights=unflatten_weights,
        skip_optimizer_state=skip_optimizer_state,
        output_dtype=output_dtype,
        drop_metaseq_req=drop_metaseq_req,
        overwrite=overwrite,
        trust_checkpoint=trust_checkpoint,
        direct=direct and not verify,  # --verify wants zip CRC32s in the outputs: torch writes them
    )
    if dry_run:
        for line in describe_reshard_plan(plan):
            logger.info("%s", line)
        return list(plan.outputs)
    if verify:
        from metaseq.reshard.verify import check_input_checksums, verify_reshard_outputs  # imports torch

        check_input_checksums(plan)  # before writing: a corrupt input writes nothing
    written = write_reshard_outputs(plan, num_workers=num_workers, checksums=verify)
    if verify:
        logger.info("%s", verify_reshard_outputs(plan))
    return written
