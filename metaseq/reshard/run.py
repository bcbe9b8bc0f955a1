"""The orchestrator: plan, check, write and verify a reshard run, alone or across launcher ranks.

    plans = reshard(ReshardOptions(input_glob_pattern="ckpts/checkpoint_last-model_part-{j}-shard*.pt",
                                   output_shard_name="out/checkpoint_last-model_part-{j}-shard{i}.pt",
                                   num_output_shards=4))

Under torchrun or srun (`world`), every rank plans (reading the inputs' pickles), then
writes the outputs whose index % world size is its rank; every phase ends with the
ranks agreeing that it succeeded, so a failure anywhere fails every rank alike and
removes what was written. `reshard_shards` does the same planning on checkpoint
dicts already in memory, for loaders that hold them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import fields
from typing import Any, Mapping, Sequence

from metaseq.errors import CheckpointLoadError, ReshardError
from metaseq.reshard import distributed as dist_run
from metaseq.reshard.distributed import World
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.plan import InputFile, Plan, assemble_output, plan_reshard, plan_structures, summarize_plan
from metaseq.reshard.progress import make_progress
from metaseq.reshard.write import available_cpus, list_jobs, missing_folders, remove_outputs, write_outputs
from metaseq.torchzip import NeedsTorch, from_torch, import_torch, to_torch, zip_records

__all__ = ["reshard", "reshard_fsdp_checkpoints", "reshard_shards"]

logger = logging.getLogger(__name__)

_IN_MEMORY = ("num_output_shards", "unflatten_weights", "skip_optimizer_state", "output_dtype", "drop_metaseq_req",
              "quiet")


def reshard(options: ReshardOptions, *, world: World | None = None) -> list[Plan]:
    """Plan every model part, then (unless `options.dry_run`) write and verify; returns the plans.

    Raises ReshardError (or CheckpointLoadError) before writing anything when inputs or
    options are wrong; a failure while writing or verifying removes this run's outputs.
    """
    created = world is not None and dist_run.open_world(world)
    try:
        dist_run.check_same(world, lambda: _run_options(options), _other_options)
        plans = dist_run.agree(world, lambda: plan_reshard(options))
        dist_run.check_same(world, lambda: _contents(plans), "planned other inputs or outputs than rank 0 (other "
                            "files under the same names: node-local copies of another checkpoint, or another working "
                            "folder?); give every rank the same files and names")
        dist_run.check_same(world, lambda: [os.path.abspath(o.path) for p in plans for o in p.outputs],
                            "would write its outputs elsewhere than another rank on its node (another working folder, "
                            "with relative paths?); start every rank in one folder, or give absolute paths",
                            group=world.node_name if world else None)
        if not options.dry_run:
            if options.verify or options.output_dtype:  # they need torch: imported now, where a signal is not lost
                import_torch()
            _write_and_verify(world or World(0, 1), plans, options)
        return plans
    finally:
        dist_run.close_world(created)


def _run_options(options: ReshardOptions) -> dict[str, Any]:
    """What every rank must be given alike: the options but the files (`_contents` compares what they name) and
    those of one process (workers, progress)."""
    return {f.name: getattr(options, f.name) for f in fields(options)
            if f.name not in ("input_glob_pattern", "output_shard_name", "num_workers", "quiet")}


def _other_options(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    name = next(k for k in ours if ours[k] != theirs[k])
    flag = "--" + name.replace("_", "-")
    return (f"was given {flag}={theirs[name]} but rank 0 {flag}={ours[name]}; every rank must run the same command "
            "(the same flags)")


def _contents(plans: Sequence[Plan]) -> list:
    """What every rank must plan alike: the output names and each input's content, as the CRC32s of its zip
    directory say (copies of one checkpoint on each node agree; files of other saves do not)."""
    found = []
    for plan in plans:
        found += [out.path for out in plan.outputs]
        for i in plan.inputs:
            try:
                found.append((i.size, sorted(r.crc for r in zip_records(i.path).values())))
            except (NeedsTorch, CheckpointLoadError):  # torch's legacy format: its size
                found.append((i.size, []))
    return found


def _write_and_verify(world: World, plans: Sequence[Plan], options: ReshardOptions) -> None:
    """Rank r writes jobs r, r + size, ... and verifies parts r, r + size, ...; every phase ends with
    the ranks agreeing that it succeeded. Inputs are checked first: a corrupt one writes nothing."""
    jobs = list_jobs(plans)
    mine, shared = jobs[world.rank :: world.size], plans[world.rank :: world.size]
    if options.verify:
        from metaseq.reshard.verify import check_input_checksums, verify_reshard_outputs  # imports torch

        dist_run.agree(world, lambda: [check_input_checksums(plan) for plan in shared])
    for plan in plans:
        into = f" into {plan.outputs[0].path}{', ...' if len(plan.outputs) > 1 else ''}" if len(plans) > 1 else ""
        logger.info("resharding %s%s", summarize_plan(plan), into)
    workers = options.num_workers or available_cpus(world.local_size)  # write_outputs caps it at len(mine)
    label = "reshard" if world.size == 1 else f"rank 0 of {world.size}"
    progress = make_progress(sum(j.out.nbytes for j in mine), len(mine), quiet=options.quiet or world.rank != 0,
                             label=label)
    written: list[str] = []
    planned = [j.out.path for j in jobs]
    folders = missing_folders(planned)  # removed again if the run fails
    try:
        dist_run.agree(world, lambda: written.extend(write_outputs(mine, num_workers=workers, progress=progress,
                                                                   crc32=options.verify)))
        if options.verify:  # on failure `verify_reshard_outputs` removes that part's outputs
            for report in dist_run.agree(world, lambda: [verify_reshard_outputs(p) for p in shared]):
                logger.info("%s", report)
    except BaseException as e:  # also what a killed rank left: its temp files, and (none were there before) outputs
        mine_only = options.overwrite or world.size == 1  # else also a dead rank's (none were there before)
        remove_outputs(written if mine_only else planned, planned=planned, folders=folders)
        if world.size > 1 and isinstance(e, ReshardError):  # raised by `agree` on every rank alike
            dist_run.barrier()  # no rank exits (and gets the launcher to kill the rest) before all have cleaned up
        raise
    if world.size > 1:
        logger.info("%d ranks wrote %d file(s)", world.size, len(jobs))


def reshard_fsdp_checkpoints(input_glob_pattern: str, output_shard_name: str, **options: Any) -> list[str]:
    """Keyword form of `reshard` for one run (kept for the deprecated shims); returns the output paths.

    Example: 4 training shards -> one inference file with original parameter names:
        reshard_fsdp_checkpoints("ckpts/checkpoint_last-model_part-0-shard*.pt",
                                 "out/reshard-model_part-0.pt",
                                 unflatten_weights=True, skip_optimizer_state=True)
    `options` are `ReshardOptions` fields.
    """
    opts = ReshardOptions(input_glob_pattern=input_glob_pattern, output_shard_name=output_shard_name, **options)
    return [out.path for plan in reshard(opts) for out in plan.outputs]


def reshard_shards(shard_dicts: Sequence[Mapping[str, Any]], **options: Any) -> list[dict[str, Any]]:
    """In-memory N -> M reshard of checkpoint dicts (torch tensors) ordered by rank; inputs are not modified.

    `options` are `ReshardOptions` fields. Each input goes through `torch.save` into memory
    and the reader, as a file would: outputs hold new tensors, and objects of classes
    outside the checkpoint format come back as `metaseq.torchzip.Opaque` records.
    """
    opts = ReshardOptions(**options)
    if unused := [k for k in options if k not in _IN_MEMORY]:  # e.g. num_output_parts: needs every part's files
        raise ReshardError(f"reshard_shards reshards one model part's shards in memory: {unused[0]} applies to files "
                           "only; use reshard(ReshardOptions(...)) on the files")
    if isinstance(shard_dicts, Mapping):
        raise ReshardError("reshard_shards takes a list of checkpoint dicts (one per shard, in rank order), not one")
    inputs = [InputFile(f"shard {r}", -1, 0, from_torch(d)[0]) for r, d in enumerate(shard_dicts)]
    names = [f"output {r}" for r in range(opts.num_output_shards)]
    plan = plan_structures(inputs, opts, names)
    return [to_torch(assemble_output(plan, out)) for out in plan.outputs]
