"""One reshard run over several processes, launched by torchrun or Slurm's srun.

    torchrun --nnodes 2 --nproc-per-node 4 -m metaseq.scripts.reshard_fsdp ...
    srun --nodes 2 --ntasks-per-node 4 python -m metaseq.scripts.reshard_fsdp ...

The ranks coordinate only through torch.distributed (gloo, `env://`). Every phase
(planning, which each rank does itself, then writing and verifying) ends with an
all_gather of the ranks' errors (`agree`), so a failure on any rank makes every rank
raise the same message; `check_same` refuses ranks whose plans differ.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

from metaseq.errors import ReshardError, one_line_error

__all__ = ["World", "agree", "barrier", "check_same", "close_world", "detect_world", "first_slurm_host", "open_world",
           "slurm_rendezvous"]

T = TypeVar("T")
# Collectives wait for the slowest rank's writes; a crashed rank is noticed sooner (closed connection).
TIMEOUT = timedelta(hours=12)
JOIN_TIMEOUT = timedelta(minutes=15)  # for every rank to start and join; a rank that never starts fails the run then
_group: Any = None  # the group of `open_world`, with TIMEOUT (None: the default group)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_size: int = 1  # processes sharing this node's CPU mask (torchrun); Slurm gives each task its own
    launcher: str = "torchrun"
    node: str = ""  # the launcher's node number (GROUP_RANK, SLURM_NODEID); "": not given, the host name tells

    def node_name(self) -> str:
        return self.node or socket.gethostname()


def detect_world(env: Mapping[str, str] | None = None) -> World | None:
    """The launcher's world from its environment variables; None when this process runs alone.

    torchrun: RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (and MASTER_ADDR/MASTER_PORT). Slurm: SLURM_PROCID and
    SLURM_NTASKS inside an srun step (SLURM_STEP_ID set); a batch script itself is not an srun step: it runs alone.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        world = World(rank, size, _env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1)
        names = ("RANK", "WORLD_SIZE")
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        names = ("SLURM_PROCID", next((k for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if env.get(k)), None))
        world = World(_env_int(env, names[0]), _env_int(env, names[1]) if names[1] else 1, 1, "slurm")
    else:
        return None
    world = replace(world, node=env.get("GROUP_RANK", env.get("SLURM_NODEID", "")))
    if not 0 <= world.rank < world.size:
        raise ReshardError(f"{names[0]}={world.rank} is not a rank of {names[1] or 'SLURM_NTASKS'}={world.size} "
                           f"(0 to {world.size - 1}); launch with torchrun or srun, which set them")
    return world if world.size > 1 else None


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ReshardError(f"{name}={env[name]!r} is not a whole number; launch with torchrun or srun, which set "
                           "it") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[003-004,010],cpu1` -> `gpu003`."""
    first = re.match(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", nodelist.strip()).group(0)
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", first)


def slurm_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for an srun step, where its variables say: rank 0 runs on the step's first node;
    the port comes from the job and step ids, so that steps of one job running at once do not meet."""
    found, nodelist = {}, env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        found["MASTER_ADDR"] = first_slurm_host(nodelist)
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if job.isdigit():
        found["MASTER_PORT"] = str(20000 + (int(job) * 1000 + (int(step) if step.isdigit() else 0)) % 20000)
    return found


def open_world(world: World) -> bool:
    """Join the gloo process group (reusing one already initialized); True when this call created it."""
    import torch.distributed as dist  # torch only when a launcher started ranks

    if dist.is_initialized():
        if dist.get_world_size() != world.size:
            raise ReshardError(f"a process group of {dist.get_world_size()} ranks exists but the launcher says "
                               f"{world.size}")
        return False
    env = os.environ
    if world.launcher == "slurm":
        for key, value in slurm_rendezvous(env).items():
            env.setdefault(key, value)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        what = {"MASTER_ADDR": "rank 0's host name", "MASTER_PORT": "a free port"}
        raise ReshardError(f"{world.launcher} rank {world.rank} of {world.size}: {' and '.join(missing)} not set; "
                           f"export {' and '.join(f'{k} ({what[k]})' for k in missing)}, or launch with torchrun")
    global _group
    try:
        dist.init_process_group("gloo", init_method="env://", rank=world.rank, world_size=world.size,
                                timeout=JOIN_TIMEOUT)
    except RuntimeError as e:  # torch's DistStoreError or DistNetworkError
        where, text = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", one_line_error(e)
        if "in use" in text.lower():
            raise ReshardError(f"{world.launcher} rank {world.rank} of {world.size}: port {where} is in use (another "
                               f"run?) ({text}); export MASTER_PORT with a free port") from None
        raise ReshardError(f"{world.launcher} rank {world.rank} of {world.size}: the ranks did not all join at "
                           f"{where} within {JOIN_TIMEOUT.total_seconds():.0f} s ({text}); check that all "
                           f"{world.size} started and reach rank 0's host") from None
    try:
        dist.barrier()  # on the joining timeout: a rank gone right after joining would leave new_group waiting 12 h
    except RuntimeError as e:
        raise _gone(world, e) from None
    _group = dist.new_group(timeout=TIMEOUT)
    return True


def close_world(created: bool) -> None:
    """Leave the process group `open_world` created (none: nothing to do, torch not imported)."""
    if created:
        import torch.distributed as dist

        global _group
        _group = None
        if dist.is_initialized():
            dist.destroy_process_group()


def agree(world: World | None, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it failed anywhere, every rank raises the first failure's message."""
    if world is None or world.size == 1:
        return fn()
    value, error = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        error = f"rank {world.rank} of {world.size}: {one_line_error(e)}"
    failed = [e for e in _gather(world, error) if e is not None]
    if failed:
        more = f" (and {len(failed) - 1} more rank(s) failed)" if len(failed) > 1 else ""
        raise ReshardError(failed[0] + more)
    return value


def check_same(world: World | None, value: Callable[[], Any], what: str | Callable[[Any, Any], str], *,
               group: Callable[[], Any] | None = None) -> None:
    """Refuse a run whose ranks get different `value()`s (not called alone); `what` says what differs, and the fix
    (or makes that text of the first rank's value and the other's). With `group`, only ranks of one `group()` (a
    node) are compared, each with the first of its group."""
    if world is None or world.size == 1:
        return
    first: dict = {}
    for rank, (key, found) in enumerate(_gather(world, (group() if group else None, value()))):
        ours = first.setdefault(key, found)
        if found != ours:
            raise ReshardError(f"rank {rank} of {world.size} {what if isinstance(what, str) else what(ours, found)}")


def _gather(world: World, value: Any) -> list:
    """Every rank's `value`, in rank order; a rank that is gone (gloo: "Connection closed by peer") in one line."""
    import torch.distributed as dist

    values: list = [None] * world.size
    try:
        dist.all_gather_object(values, value, group=_group)
    except RuntimeError as e:
        raise _gone(world, e) from None
    return values


def _gone(world: World, e: RuntimeError) -> ReshardError:
    return ReshardError(f"rank {world.rank} of {world.size}: another rank stopped (killed?) before the ranks agreed "
                        f"({one_line_error(e)[:200]}); see its log, then run again")


def barrier() -> None:
    """Wait for every rank; a rank that is gone is reported by gloo as an error, which is ignored here."""
    import torch.distributed as dist

    with contextlib.suppress(RuntimeError):  # e.g. "Connection closed by peer"
        dist.barrier(group=_group)
