"""Build, write, find and load raw FSDP training checkpoints (one file per rank).

The layout is the one in docs/checkpoint_format.md: `model` is fairscale's
`local_state_dict()`, `shard_metadata` its `local_metadata_dict()`, and
`last_optimizer_state` this rank's (sharded, flat) `optimizer.state_dict()`.
With model parallelism, global rank r = dp_rank * P + mp_rank holds the file
`PREFIX-model_part-{mp_rank}-shard{dp_rank}.pt`.
"""
from __future__ import annotations

import copy
import contextlib
import errno
import glob
import logging
import math
import os
import re
from argparse import Namespace
from collections import Counter
from typing import Any, Callable, Mapping, NamedTuple

import torch

from metaseq.distributed.fsdp import lazy_init_all
from metaseq.errors import UserError, short_repr
from metaseq.file_io import (atomic_link, atomic_torch_save, check_no_broken_links, checkpoint_prefix, folder_hint,
                             glob_files, is_glob, load_checkpoint, natural_sort_key, shard_file_name, shard_glob)
from metaseq.reshard.layout import analyze_model, missing_shards_hint
from metaseq.reshard.model_parallel import global_shapes
from metaseq.reshard.optim import analyze_optimizer
from metaseq.reshard.plan import check_rank_order, check_same_save, read_inputs
from metaseq.reshard.schema import cfg_value, is_tensor, last_update
from metaseq.torchzip import Opaque, Size, read_checkpoint

__all__ = [
    "RestoreError",
    "Restored",
    "build_training_checkpoint",
    "find_restore_files",
    "is_consolidated_file",
    "load_training_state",
    "read_restore_files",
    "remove_replaced_shards",
    "save_training_checkpoint",
    "saved_progress",
]

logger = logging.getLogger(__name__)

_PART_SHARD = re.compile(r"-model_part-(\d+)-shard(\d+)\.pt$")
_PART_FILE = re.compile(r"^(.*)-model_part-(\d+)\.pt$")
_RESHARD_MP = "python -m metaseq.scripts.reshard_model_parallel"


class RestoreError(ValueError):
    """--restore-file cannot be used as given; the message says why and what to do."""


def build_training_checkpoint(
    model: Any,
    optimizer: torch.optim.Optimizer,
    *,
    num_updates: int,
    train_iterator: dict[str, int],
    cfg: dict[str, Any],
    metrics: dict[str, float],
    training_time: float,
    run_id: str | None = None,
) -> dict[str, Any]:
    """This rank's checkpoint dict; `model` is the root FSDP instance. `run_id` (the same on every rank of a run)
    tells apart the files of two runs that agree on seed and update."""
    return {
        "model": model.local_state_dict(),
        "shard_metadata": model.local_metadata_dict(),
        "last_optimizer_state": optimizer.state_dict(),
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": type(optimizer).__name__,
                "lr_scheduler_state": {"lr": optimizer.param_groups[0]["lr"]},
                "num_updates": num_updates,
            }
        ],
        "extra_state": {
            "metrics": metrics,
            "previous_training_time": training_time,
            "train_iterator": train_iterator,
            **({"run_id": run_id} if run_id else {}),
        },
        "cfg": cfg,
    }


def save_training_checkpoint(
    state: dict[str, Any], save_dir: str, *, rank: int, num_updates: int, model_part: int = 0,
    wait: Callable[[], None] = lambda: None,
) -> list[str]:
    """Write `checkpoint_{n}-...` of this shard (`rank`: the data-parallel rank) atomically, then `wait()` (for every
    rank's), then make `checkpoint_last-...` that file (a hard link: nothing more to write, so a full disk cannot
    stop one rank's after another's): a save that fails on any rank leaves checkpoint_last as it was. A write
    error is raised as an OSError naming the file."""
    numbered, last = (os.path.join(save_dir, shard_file_name(prefix, model_part, rank))
                      for prefix in _checkpoint_names(num_updates))
    try:
        atomic_torch_save(state, numbered)
    except OSError as e:
        fix = "free space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
        left = (f"checkpoint_last is left at the last complete save: {fix} (or give another --save-dir) and "
                "restore from it") if os.path.isfile(last) else (
                f"there is no earlier save: {fix} (or give another --save-dir) and train again")
        raise OSError(e.errno, f"{numbered}: cannot save it ({e.strerror or e}); {left}") from None
    wait()
    try:
        atomic_link(numbered, last)
    except OSError as e:
        complete = os.path.join(save_dir, f"checkpoint_{num_updates}.pt")
        raise OSError(e.errno, f"{last}: cannot replace it ({e.strerror or e}); every rank wrote its "
                      f"checkpoint_{num_updates} file: restore from {complete}") from None
    return [numbered, last]


def _checkpoint_names(num_updates: int) -> tuple[str, str]:
    return f"checkpoint_{num_updates}", "checkpoint_last"


def remove_replaced_shards(save_dir: str, num_updates: int, num_parts: int, shards_per_part: int) -> list[str]:
    """Remove the shard files of the checkpoints a save at `num_updates` replaces that no rank of this run writes
    (an earlier run's with more shards or parts, as before a reshard): read back with the new ones, they would
    make a mixed checkpoint. Returns the paths removed."""
    removed = []
    for prefix in _checkpoint_names(num_updates):
        for part, files in sorted(_shards_by_part(os.path.join(save_dir, prefix)).items()):
            for path in files:
                if part >= num_parts or int(_PART_SHARD.search(path)[2]) >= shards_per_part:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        removed.append(path)
    return removed


def is_consolidated_file(restore_file: str) -> bool:
    """A single consolidated file (e.g. `reshard-model_part-0.pt`) rather than a shard stem."""
    return os.path.isfile(restore_file) and not re.search(r"-shard\d+\.pt$", restore_file)


def find_restore_files(restore_file: str, world_size: int, model_parallel_size: int = 1) -> list[str]:
    """The file each global rank loads for `--restore-file`, checked against the world and model-parallel sizes.

    A consolidated file holds one model part: with P = 1 every rank loads it; with P > 1
    name one of `STEM-model_part-{j}.pt` and rank r loads part r % P. A stem
    (`DIR/checkpoint_last.pt`) names the shard files `DIR/checkpoint_last-model_part-{j}-shard{i}.pt`:
    P parts of D = world_size / P shards each; rank r loads part r % P, shard r // P.
    """
    if is_consolidated_file(restore_file):
        parts = _consolidated_parts(restore_file, model_parallel_size)
        return [parts[r % model_parallel_size] for r in range(world_size)]
    if hint := folder_hint(restore_file):
        raise RestoreError(f"--restore-file {restore_file}{hint}")
    matches = glob_files(restore_file) if is_glob(restore_file) else [restore_file]
    shards = [m for m in matches if re.search(r"shard\d+\.pt$", m) or len(matches) > 1 and not _PART_FILE.match(m)]
    if shards and os.path.isfile(shards[0]) and not _PART_SHARD.search(shards[0]):
        raise RestoreError(f"--restore-file {restore_file}: {shards[0]} is not named as training names its shards "
                           "(STEM-model_part-J-shardI.pt), which restoring reads back; rename them so, or reshard them "
                           "into such names (reshard_fsdp --output-shard-name "
                           "'NEW_DIR/checkpoint_last-model_part-0-shard{i}.pt') and restore NEW_DIR/checkpoint_last.pt")
    if is_glob(restore_file):  # it was read as a stem: "no shard files match DIR/*-shard[*]-model_part-0-shard*.pt"
        example = checkpoint_prefix(matches[0]) + ".pt" if matches else "DIR/checkpoint_last.pt"
        raise RestoreError(f"--restore-file {restore_file} is a glob; name the save instead, e.g. --restore-file "
                           f"{example} (every part's files are found from it)")
    if _PART_FILE.match(restore_file):  # `STEM-model_part-J.pt`, as a consolidated part is named
        raise RestoreError(f"--restore-file {restore_file}: no such file")
    prefix = checkpoint_prefix(restore_file)
    by_part = _shards_by_part(prefix)
    if not by_part:
        pattern = shard_glob(prefix)
        raise RestoreError(f"--restore-file {restore_file}: no shard files match {pattern}")
    _check_part_count(restore_file, sorted(by_part), model_parallel_size)
    for part, files in sorted(by_part.items()):
        _check_shards(restore_file, prefix, part, files, world_size, model_parallel_size)
    return [by_part[r % model_parallel_size][r // model_parallel_size] for r in range(world_size)]


class Restored(NamedTuple):
    num_updates: int  # the update the files were saved at
    cfg: Mapping[str, Any]  # input 0's
    model_cfg: Mapping[str, Any] | Namespace  # cfg['model'], as ModelConfig.from_dict takes it
    shapes: Mapping[str, Size]  # every parameter's global shape (all model parts together), and every buffer's
    samples_seen: int | None  # the data position (extra_state['train_iterator']); None: not there


def read_restore_files(restore_file: str, world_size: int, model_parallel_size: int = 1, *,
                       trust: bool = False) -> Restored:
    """`find_restore_files`, then every file's structure read (no tensor data) and checked as the reshard tool checks
    its inputs (one save, one model, every shard there), and unpickled as the ranks will load it (`trust`: see
    `load_checkpoint`; tensors mapped, not read), so that the ranks never start on a set they cannot load."""
    # Each file once, in rank order: rank r loads part r % P, shard r // P.
    unique = list(dict.fromkeys(find_restore_files(restore_file, world_size, model_parallel_size)))
    parts = model_parallel_size
    try:
        structures = [i.structure for i in read_inputs(unique, trust=trust)]
        check_same_save(structures, unique)
        declared = cfg_value(structures[0].get("cfg"), "common", "model_parallel_size")
        if isinstance(declared, int) and declared > parts:  # a part's files alone hold a slice of each weight
            raise RestoreError(
                f"--restore-file {restore_file}: {unique[0]} is one of {declared} model parts (cfg['common']"
                f"['model_parallel_size']) but only {parts} part(s) would be restored; restore all {declared} "
                f"(--model-parallel-size {declared}, every part's files beside it), or merge them first with "
                f"{_RESHARD_MP} --num-output-parts {parts}")
        layouts = [analyze_model(structures[j::parts], unique[j::parts]) for j in range(parts)]
        check_rank_order(structures, unique)  # in rank order
        shapes = {**global_shapes(layouts), **{e.key: e.shape for e in layouts[0].dicts[0].extras
                                                 if e.shape is not None}}
        for j, layout in enumerate(layouts):  # optimizer state as the reshard tool takes it (what the ranks load)
            analyze_optimizer(structures[j::parts], layout)
    except UserError as e:  # the fix the reshard tool's checks name is a flag training has not
        fix = "restore a copy without it: reshard_fsdp --skip-optimizer-state True"
        text = str(e).replace("pass --skip-optimizer-state", fix).replace("only FSDP shards can be resharded", (
            "training restores what it or the reshard tools wrote (with shard_metadata), not a plain state dict"))
        raise RestoreError(f"--restore-file {restore_file}: {text}") from None
    try:
        for path in unique:
            load_checkpoint(path, mmap=True, trust=trust)
    except UserError as e:
        hint = ("; upstream metaseq's data loader state holds such objects: python -m metaseq.scripts.reshard_fsdp "
                "--drop-metaseq-req writes a copy without it") if "objects of" in str(e) or "outside" in str(e) else ""
        raise RestoreError(f"--restore-file {restore_file}: {e}{hint}") from None
    if is_consolidated_file(restore_file) and not layouts[0].unflattened and world_size > parts:
        raise RestoreError(
            f"--restore-file {restore_file} holds the flat weights of one FSDP shard, which load only with one rank "
            f"per model part (--world-size {parts}); to restore at any world size, reshard it with --unflatten-weights"
        )
    osd = structures[0].get("last_optimizer_state")
    states = osd.get("state") if isinstance(osd, Mapping) and layouts[0].unflattened else None
    if isinstance(states, Mapping) and any(f"{n}_scale" in e for e in states.values() if isinstance(e, Mapping)
                                           for n in e):
        raise RestoreError(f"--restore-file {restore_file}: its consolidated optimizer state holds --fp16-adam-stats "
                           "moments, each scaled by its own rank's factor; restore from the run's flat shards")
    cfg = structures[0].get("cfg")
    model = cfg.get("model") if isinstance(cfg, Mapping) else None
    if isinstance(model, Opaque) and isinstance(model.state, Mapping):  # upstream metaseq's argparse.Namespace
        model = Namespace(**model.state)
    if not isinstance(model, (Mapping, Namespace)):
        raise RestoreError(f"--restore-file {restore_file}: {unique[0]} has no cfg['model'] (the model's sizes); "
                           "restore a checkpoint that metaseq.cli.train, the reshard tools or convert_from_hf wrote")
    elements: Counter = Counter()  # per floating-point dtype (buffers such as `decoder.version` stay float32)
    for value in structures[0]["model"].values():
        if is_tensor(value) and value.dtype.is_floating_point:
            elements[repr(value.dtype)] += value.numel()
    if elements and (dtype := elements.most_common(1)[0][0]) != "torch.float32":
        logger.warning("--restore-file %s: the weights are %s; training runs in float32, so they are loaded and "
                       "saved as float32 (reshard_fsdp --output-dtype casts a save back)", restore_file, dtype)
    progress = [saved_progress(s) for s in structures]
    (updates, _, time), positions = progress[0], [samples for _, samples, _ in progress]
    for what, value, kinds in (("optimizer_history[-1]['num_updates']", updates, (int,)),
                               ("extra_state['train_iterator']['samples_seen']", positions[0], (int,)),
                               ("extra_state['previous_training_time']", time, (int, float))):
        if value is not None and (type(value) not in kinds or not 0 <= value < math.inf):
            raise RestoreError(f"--restore-file {restore_file}: {unique[0]}'s {what} is {short_repr(value, 40)}, "
                               f"not {'a count' if kinds == (int,) else 'a number of seconds'}; restore files "
                               "training wrote")
    if len(set(positions)) > 1:  # each rank would take its own: the data-parallel ranks' batches would not fit
        odd = next(i for i, p in enumerate(positions) if p != positions[0])
        raise RestoreError(f"--restore-file {restore_file}: {unique[odd]} is at sample {positions[odd]} of the data "
                           f"but {unique[0]} at {positions[0]} (extra_state['train_iterator']['samples_seen']): the "
                           "files were not saved together; restore the files of one save")
    return Restored(updates or 0, cfg, model, shapes, positions[0])


def saved_progress(ckpt: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(num_updates, samples_seen, previous_training_time) as a training checkpoint holds them (`optimizer_history`,
    `extra_state` and its `train_iterator`); None where absent."""
    extra = ckpt.get("extra_state") if isinstance(ckpt.get("extra_state"), Mapping) else {}
    position = extra.get("train_iterator")
    samples = position.get("samples_seen") if isinstance(position, Mapping) else None
    return last_update(ckpt).get("num_updates"), samples, extra.get("previous_training_time")


def _missing_shards(files: list[str]) -> str:
    """`missing_shards_hint` of shard files (their pickles read; "" for any that cannot be)."""
    try:
        return missing_shards_hint([read_checkpoint(path)[0] for path in files])
    except Exception:  # noqa: BLE001 -- only a hint: the files are read and checked again, with their own errors
        return ""


def _shards_by_part(prefix: str) -> dict[int, list[str]]:
    """{model part: its shard files in natural order} for `PREFIX-model_part-*-shard*.pt`."""
    by_part: dict[int, list[str]] = {}
    matches = glob.glob(shard_glob(prefix, "*"))
    check_no_broken_links(matches)
    for path in matches:
        match = _PART_SHARD.search(path)
        if match and path[: match.start()] == prefix:
            by_part.setdefault(int(match.group(1)), []).append(path)
    return {j: sorted(files, key=natural_sort_key) for j, files in by_part.items()}


def _consolidated_parts(restore_file: str, model_parallel_size: int) -> list[str]:
    """The per-part consolidated files of the set `restore_file` belongs to, in part order."""
    match = _PART_FILE.match(restore_file)
    if match is None:
        if model_parallel_size == 1:
            return [restore_file]
        raise RestoreError(
            f"--restore-file {restore_file}: a consolidated file holds one model part but "
            f"--model-parallel-size={model_parallel_size}; name one of the per-part files "
            f"STEM-model_part-{{j}}.pt (j = 0..{model_parallel_size - 1})"
        )
    found = {}
    matches = glob.glob(f"{glob.escape(match.group(1))}-model_part-*.pt")
    check_no_broken_links(matches)
    for path in matches:
        other = _PART_FILE.match(path)
        if other and other.group(1) == match.group(1):
            found[int(other.group(2))] = path
    _check_part_count(restore_file, sorted(found), model_parallel_size)
    return [found[j] for j in range(model_parallel_size)]


def _check_part_count(restore_file: str, parts: list[int], model_parallel_size: int) -> None:
    if len(parts) < model_parallel_size and parts == list(range(len(parts))):
        raise RestoreError(
            f"--restore-file {restore_file}: only model part(s) {parts} are there but --model-parallel-size="
            f"{model_parallel_size}; are the other parts' files missing? (every part's files go in one folder; a "
            f"checkpoint of {len(parts)} part(s) restores with --model-parallel-size={len(parts)})"
        )
    if len(parts) != model_parallel_size:
        raise RestoreError(
            f"--restore-file {restore_file}: the checkpoint has {len(parts)} model parts but "
            f"--model-parallel-size={model_parallel_size}; pass --model-parallel-size={len(parts)}, or convert it to "
            f"{model_parallel_size} parts first with {_RESHARD_MP}"
        )
    if parts != list(range(model_parallel_size)):
        raise RestoreError(
            f"--restore-file {restore_file}: model parts {parts} found, expected 0..{model_parallel_size - 1}; "
            "is a part missing?"
        )


def _check_shards(restore_file: str, prefix: str, part: int, files: list[str], world_size: int,
                  model_parallel_size: int) -> None:
    """Part `part` must have exactly one shard file per data-parallel rank, named shard0..shard{D-1}."""
    dp_size = world_size // model_parallel_size
    hint = _missing_shards(files) if len(files) < dp_size else ""
    if hint:
        hint += "; if they are complete, "
    if len(files) != dp_size and model_parallel_size == 1:
        pattern = shard_glob(prefix)
        raise RestoreError(
            f"--restore-file {restore_file}: found {len(files)} shard files but --world-size={world_size}"
            f"{hint or '; '}reshard first: python -m metaseq.scripts.reshard_fsdp --input-glob-pattern '{pattern}' "
            f"--output-shard-name 'NEW_DIR/checkpoint_last-model_part-0-shard{{i}}.pt' "
            f"--num-output-shards {world_size}"
        )
    if len(files) != dp_size:
        pattern = shard_glob(prefix, "{j}")
        raise RestoreError(
            f"--restore-file {restore_file}: found {len(files)} shard files of model part {part} but the "
            f"data-parallel size is {dp_size} (--world-size={world_size} / --model-parallel-size="
            f"{model_parallel_size}){hint or '; '}pass --world-size={len(files) * model_parallel_size}, or reshard "
            f"first: python -m metaseq.scripts.reshard_fsdp --input-glob-pattern '{pattern}' --output-shard-name "
            f"'NEW_DIR/checkpoint_last-model_part-{{j}}-shard{{i}}.pt' --num-output-shards {dp_size}"
        )
    expected = [shard_file_name(prefix, part, i) for i in range(dp_size)]
    if files != expected:
        raise RestoreError(f"--restore-file {restore_file}: expected shard files {expected}, found {files}")


def load_training_state(model: Any, optimizer: torch.optim.Optimizer, ckpt: dict[str, Any]) -> None:
    """Load this rank's checkpoint into the FSDP `model` (root instance) and its optimizer.

    `ckpt` is this rank's flat shard (`load_local_state_dict`, needs every instance's lazy
    init first), or a consolidated file of this rank's model part: unflattened weights and
    fairscale's consolidated optimizer layout, valid for any data-parallel size.
    """
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
        optimizer.load_state_dict(_moments_as_values(osd))


def _moments_as_values(osd: dict[str, Any]) -> dict[str, Any]:
    """`osd` with the moments of upstream's --fp16-adam-stats (fp16 `NAME` and this rank's 0-dim `NAME_scale`,
    value = moment x scale) as the fp32 values torch's Adam holds; other state as it is."""
    state = {}
    for k, entry in osd["state"].items():
        entry = dict(entry)
        for name in [n for n in entry if f"{n}_scale" in entry]:
            entry[name] = entry[name].float() * entry.pop(f"{name}_scale").float()
        state[k] = entry
    return {**osd, "state": state}
