"""A whole reshard run: every model part named by `{j}`, in one process or across launcher ranks.

    plans = reshard_model_parts(
        "ckpts/checkpoint_last-model_part-{j}-shard*.pt",
        "out/checkpoint_last-model_part-{j}-shard{i}.pt",
        plan_options={"num_output_shards": 4},
        num_workers=None,               # default: as many as the memory bound allows
        world=detect_world(),           # torchrun / srun ranks, or None
    )

Jobs are the (model part, output shard) pairs in part order; under a launcher, rank r
writes the jobs whose index % world size == r, reading only the inputs they need.
"""
from __future__ import annotations

import fnmatch
import glob
import logging
import re
from typing import Any, Mapping, Sequence

from metaseq.reshard import distributed as dist_run
from metaseq.reshard.distributed import World
from metaseq.reshard.driver import ReshardPlan, plan_reshard_fsdp, summarize_plan
from metaseq.reshard.parallel import (
    PROCESS_BYTES,
    OutputJob,
    available_cpus,
    default_num_workers,
    estimated_peak,
    held_bytes,
    list_jobs,
    memory_bound,
    remove_outputs,
    threaded,
    write_jobs,
)
from metaseq.reshard.progress import make_progress
from metaseq.reshard.schema import ReshardError

__all__ = ["expand_model_parts", "plan_model_parts", "reshard_model_parts"]

logger = logging.getLogger(__name__)

PART = "{j}"
MIB = 1 << 20


def expand_model_parts(input_glob_pattern: str, output_shard_name: str) -> list[tuple[str, str]]:
    """(input glob, output name) per model part; `{j}` in both becomes each part number found on disk.

    Without `{j}` this is the one pair given. Part numbers keep their spelling
    (`model_part-01` stays `01`) and are ordered numerically.
    """
    in_has, out_has = PART in input_glob_pattern, PART in output_shard_name
    if not in_has and not out_has:
        return [(input_glob_pattern, output_shard_name)]
    if in_has != out_has:
        has, lacks = "--input-glob-pattern", "--output-shard-name"
        if out_has:
            has, lacks = lacks, has
        raise ReshardError(
            f"{has} has '{PART}' but {lacks} has not; put '{PART}' (the model part number) in both, e.g. "
            "'ckpts/checkpoint_last-model_part-{j}-shard*.pt' and 'out/reshard-model_part-{j}.pt'"
        )
    parts = _find_parts(input_glob_pattern)
    if not parts:
        raise ReshardError(
            f"--input-glob-pattern {input_glob_pattern!r} matches no files (with '{PART}' as a model part number)"
        )
    return [(input_glob_pattern.replace(PART, j), output_shard_name.replace(PART, j)) for j in parts]


def _find_parts(pattern: str) -> list[str]:
    """The digit strings that, put in place of `{j}`, make the pattern match some file."""
    found = set()
    for path in glob.glob(pattern.replace(PART, "*")):
        for digits in set(re.findall(r"\d+", path)):
            if fnmatch.fnmatchcase(path, pattern.replace(PART, digits)):
                found.add(digits)
    return sorted(found, key=int)


def plan_model_parts(input_glob_pattern: str, output_shard_name: str, **plan_options: Any) -> list[ReshardPlan]:
    """`plan_reshard_fsdp` for every model part; options as there."""
    parts = expand_model_parts(input_glob_pattern, output_shard_name)
    plans = [plan_reshard_fsdp(pattern, name, **plan_options) for pattern, name in parts]
    seen: dict[str, str] = {}
    for plan in plans:
        for path in plan.outputs:
            if path in seen:
                raise ReshardError(f"--output-shard-name: {path} would be written for two model parts; use '{PART}'")
            seen[path] = plan.inputs[0]
    return plans


def reshard_model_parts(
    input_glob_pattern: str,
    output_shard_name: str,
    *,
    plan_options: Mapping[str, Any],
    num_workers: int | None = None,
    verify: bool = False,
    dry_run: bool = False,
    quiet: bool = False,
    world: World | None = None,
) -> list[ReshardPlan]:
    """Plan every part, then (unless `dry_run`) write all outputs; returns the plans.

    `num_workers`: processes writing outputs (None: `default_num_workers`); `verify`: as
    `reshard_fsdp_checkpoints`; `quiet`: no progress. With a `world`, rank 0 plans and
    each rank writes its share; any failure makes every rank raise and remove its outputs.
    """
    if num_workers is not None and num_workers < 1:
        raise ReshardError(f"--num-workers={num_workers}: must be at least 1")
    # --verify wants zip CRC32s in the outputs: torch writes them.
    plan_options = {**plan_options, "direct": plan_options.get("direct", True) and not verify}
    if world is None:
        plans = plan_model_parts(input_glob_pattern, output_shard_name, **plan_options)
        if not dry_run:
            _check_inputs(plans, verify)
            _write_and_verify(plans, list_jobs(plans), num_workers, verify, quiet, cpus=available_cpus())
        return plans
    created = dist_run.open_world(world)
    try:
        plans = dist_run.decide_on_rank_zero(
            world, lambda: plan_model_parts(input_glob_pattern, output_shard_name, **plan_options)
        )
        if not dry_run:
            _run_on_world(world, plans, num_workers, verify, quiet)
        return plans
    finally:
        dist_run.close_world(created)


def _check_inputs(plans: Sequence[ReshardPlan], verify: bool) -> None:
    if verify:
        from metaseq.reshard.verify import check_input_checksums  # imports torch

        for plan in plans:
            check_input_checksums(plan)  # before writing: a corrupt input writes nothing


def _write_and_verify(
    plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], num_workers: int | None, verify: bool, quiet: bool, *,
    cpus: int,
) -> None:
    written = _write(plans, jobs, num_workers, verify, quiet, cpus=cpus)
    try:
        _verify(plans, verify)
    except BaseException:
        remove_outputs(written)
        raise


def _write(
    plans: Sequence[ReshardPlan],
    jobs: Sequence[OutputJob],
    num_workers: int | None,
    checksums: bool,
    quiet: bool,
    *,
    cpus: int,
    label: str = "reshard",
) -> list[str]:
    """Write `jobs`, all or nothing; returns the paths written."""
    for plan in plans:
        into = f" into {plan.outputs[0]}{', ...' if len(plan.outputs) > 1 else ''}" if len(plans) > 1 else ""
        logger.info("resharding %s%s", summarize_plan(plan), into)
    workers = _choose_workers(num_workers, plans, jobs, cpus, checksums)
    progress = make_progress(sum(j.nbytes for j in jobs), len(jobs), quiet=quiet, label=label)
    return write_jobs(plans, jobs, num_workers=workers, progress=progress, checksums=checksums)


def _verify(plans: Sequence[ReshardPlan], verify: bool) -> None:
    """`--verify` after writing; on failure `verify_reshard_outputs` removes that part's outputs."""
    if verify:
        from metaseq.reshard.verify import verify_reshard_outputs  # imports torch

        for plan in plans:
            logger.info("%s", verify_reshard_outputs(plan))


def _choose_workers(
    requested: int | None, plans: Sequence[ReshardPlan], jobs: Sequence[OutputJob], cpus: int, checksums: bool
) -> int:
    held = held_bytes(plans, jobs, checksums)
    if requested is not None:
        workers = max(1, min(requested, len(jobs)))
        if workers > 1 and not threaded(plans):
            logger.info("%d worker processes: peak memory about %d MiB", workers, estimated_peak(workers, held) // MIB)
        return workers
    workers = default_num_workers(plans, jobs, cpus=cpus, checksums=checksums)
    if workers < min(cpus, len(jobs)):
        logger.info(
            "%d writer process(es): more would not pay off or would exceed the memory bound of %d MiB "
            "(--num-workers K > 1: about %d MiB + K x %d MiB)",
            workers, memory_bound(plans, jobs) // MIB, 2 * PROCESS_BYTES // MIB, (PROCESS_BYTES + held) // MIB,
        )
    return workers


def _run_on_world(
    world: World, plans: Sequence[ReshardPlan], num_workers: int | None, verify: bool, quiet: bool
) -> None:
    """Rank r writes jobs r, r + size, ...; every phase ends with the ranks agreeing that it succeeded."""
    jobs = list_jobs(plans)
    mine = [j for j in jobs if j.index % world.size == world.rank]
    shared = plans[world.rank :: world.size]  # --verify work, spread by part
    dist_run.agree(world, lambda: _check_inputs(shared, verify))
    written: list[str] = []
    try:
        cpus, label = available_cpus(world.local_size), f"rank 0 of {world.size}"
        quiet = quiet or world.rank != 0  # one progress display: rank 0's
        dist_run.agree(world, lambda: written.extend(
            _write(plans, mine, num_workers, verify, quiet, cpus=cpus, label=label)
        ))
        dist_run.agree(world, lambda: _verify(shared, verify))
    except ReshardError:  # raised by `agree` on every rank alike
        remove_outputs(written)
        dist_run.barrier()  # no rank exits (and gets the launcher to kill the rest) before all have cleaned up
        raise
    except BaseException:
        remove_outputs(written)
        raise
    logger.info("%d ranks wrote %d file(s)", world.size, len(jobs))
