"""The reshard planner: for every output file, its tensors and the runs of input elements that make them.

    plans = plan_reshard(options)        # one Plan per model part; nothing written
    obj = assemble_output(plan, out)     # an output's object, tensors pointing at input bytes
    print("\\n".join(describe_plan(plan)))

Planning finds the inputs, names the outputs, reads every input's pickle once
(`metaseq.torchzip`: structure and byte positions, no tensor data), checks them against
each other and the options, and computes every output's tensors once. A tensor of an
output is a shape, a dtype and `Run`s: blocks of elements of one input tensor, so
writing is copying bytes. FSDP's flattening and sharding are one way of cutting a
parameter's elements into runs; every other top-level key is carried from input 0.
"""
from __future__ import annotations

import collections
import copy
import fnmatch
import glob
import itertools
import logging
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from metaseq.errors import ReshardError, UserError
from metaseq.file_io import (file_in_the_way, find_model_parts, find_shards, load_checkpoint, model_part_number,
                             natural_sort_key, pattern_forms, summarize_paths)
from metaseq.reshard.layout import ModelLayout, ParamDict, analyze_model, output_cuts, output_metadata
from metaseq.reshard.optim import (OptimLayout, analyze_optimizer, assemble_consolidated_optimizer,
                                   assemble_flat_optimizer, check_per_rank_state, optimizer_targets)
from metaseq.reshard.model_parallel import check_parts_fit, cut_model_parts, global_shapes
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.ranges import OutTensor, Run, plan_range
from metaseq.reshard.schema import (OPTIM, cfg_fields, cfg_value, is_omegaconf, is_tensor, last_update, resolve,
                                    tensors_in)
from metaseq.torchzip import (Copy, DType, NeedsTorch, Opaque, Size, Storage, TensorRef, from_torch,
                              read_checkpoint)

__all__ = ["InputFile", "OutFile", "Plan", "Source", "analyze_inputs", "assemble_output", "check_output_name",
           "check_rank_order", "check_same_save", "cut_model_parallel", "describe_plan", "expand_model_parts",
           "output_paths", "output_tensors", "plan_model_parallel", "plan_reshard", "plan_structures", "read_inputs",
           "saved_at", "summarize_plan", "tensor_ref", "whole_tensor"]

logger = logging.getLogger(__name__)

PART = "{j}"


@dataclass(frozen=True)
class InputFile:
    path: str  # a label for inputs given in memory
    size: int  # with mtime_ns: the file must not change between planning and writing (-1: in memory)
    mtime_ns: int
    structure: Any  # the checkpoint, tensors as TensorRef


@dataclass(frozen=True)
class Source:
    model: ModelLayout
    optim: OptimLayout | None  # None: no optimizer state to reshard (absent, None or skipped)


@dataclass(frozen=True)
class OutFile:
    path: str
    rank: int  # output shard index
    tensors: tuple[OutTensor, ...]
    part: int = 0  # output model part
    source: Source | None = None  # its part's layout when model parallelism changes (else the plan's)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Plan:
    options: ReshardOptions
    inputs: tuple[InputFile, ...]  # ordered by shard index
    source: Source
    outputs: tuple[OutFile, ...]
    rank_zero_only: tuple[str, ...] = ()  # train_iterator keys only input 0 holds (see `_rank_zero_only`)


def plan_reshard(options: ReshardOptions) -> list[Plan]:
    """One plan per model part (`{j}` in both names, else one; with `num_output_parts`, one plan from every part's
    inputs to Q x M outputs); raises before anything is written."""
    check_output_name(options.output_shard_name, options.num_output_shards)
    if options.num_output_parts is not None:
        plans = [plan_model_parallel(options)]
    else:
        parts = []
        for pattern, name in expand_model_parts(options.input_glob_pattern, options.output_shard_name):
            try:
                parts.append((find_shards(pattern), name))
            except UserError as e:
                raise ReshardError(str(e)) from None
            logger.info("found %d input shard(s) matching %r", len(parts[-1][0]), pattern)
        every_input = [path for inputs, _ in parts for path in inputs]  # no part may write over another's
        plans = []
        for inputs, name in parts:
            outputs = output_paths(name, options.num_output_shards, every_input, overwrite=options.overwrite)
            plans.append(plan_structures(read_inputs(inputs, trust=options.trust_checkpoint), options, outputs))
        firsts = [plan.inputs[0].structure for plan in plans], [plan.inputs[0].path for plan in plans]
        check_same_save(*firsts)
        check_rank_order(*firsts, len(plans))
    seen: dict[str, str] = {}  # names can alias one file ('o/{i}/../s.pt', links): by real path
    for path in (out.path for plan in plans for out in plan.outputs):
        real = os.path.realpath(path)
        if real in seen:
            raise ReshardError(f"--output-shard-name: {seen[real]} and {path} are the same file; give each output a "
                               "file name of its own")
        seen[real] = path
    _check_nothing_left_beside(options.output_shard_name, set(seen))
    return plans


def _check_nothing_left_beside(name: str, outputs: set[str]) -> None:
    """Files named like the outputs, other numbers in `{i}` or `{j}` (an earlier run's extra shards or parts),
    would be read back with them as one checkpoint: refuse them."""
    pieces = re.split(r"\{[ij]\}", name)
    if len(pieces) == 1:
        return
    like = re.compile(r"\d+".join(map(re.escape, pieces)))
    candidates = glob.glob("*".join(map(glob.escape, pieces)))
    left = [p for p in candidates if like.fullmatch(p) and os.path.realpath(p) not in outputs]
    if left:
        left.sort(key=natural_sort_key)
        raise ReshardError(f"--output-shard-name: {summarize_paths(left)}, named like the outputs, would stay beside "
                           "them (from an earlier run?) and be read back with them; remove them or write elsewhere")


def plan_model_parallel(options: ReshardOptions, *, flag: str = "--input-glob-pattern") -> Plan:
    """P parts x N shards (or P consolidated files) -> `num_output_parts` x `num_output_shards` files; `flag` names
    the input pattern in messages."""
    try:
        groups = find_model_parts(options.input_glob_pattern.replace("{j}", "*"), flag=flag)  # '{j}': every part
    except UserError as e:
        raise ReshardError(str(e)) from None
    paths = [path for group in groups for path in group]
    logger.info("found %d model part(s) x %d file(s) matching %r", len(groups), len(groups[0]),
                options.input_glob_pattern)
    inputs = read_inputs(paths, trust=options.trust_checkpoint)
    num_parts, files = options.num_output_parts, []
    (sources,) = cut_model_parallel(inputs, groups, options, (num_parts,), flag=flag)
    for q, (names, source) in enumerate(zip(_part_names(options, num_parts, paths), sources)):
        if source.optim is not None:  # kept only as the parts are (see cut_model_parts), and the shards
            check_per_rank_state(source.optim, source.model, options.num_output_shards, options.unflatten_weights)
        files += [OutFile(name, m, tuple(output_tensors(source, options, m)), q, source)
                  for m, name in enumerate(names)]
    return _checked(Plan(options, tuple(inputs), files[0].source, tuple(files)))


def cut_model_parallel(inputs: Sequence[InputFile], groups: Sequence[Sequence[str]], options: ReshardOptions,
                       counts: Sequence[int], *, flag: str = "--input-glob-pattern") -> list[list[Source]]:
    """For each number of output parts in `counts`, the Source of each part, from P parts x N files (their names
    `groups`, read part by part as `inputs`), checked once to be one save of one model that those parts fit."""
    structures, paths = [i.structure for i in inputs], [i.path for i in inputs]
    check_same_save(structures, paths)
    declared = cfg_value(structures[0].get("cfg"), "common", "model_parallel_size")
    if isinstance(declared, int) and declared > len(groups):
        raise ReshardError(
            f"model_part-{len(groups)} is missing: cfg['common']['model_parallel_size'] of {groups[0][0]} says the "
            f"model has {declared} parts but {flag} matches {len(groups)}"
        )
    n = len(groups[0])  # files per part: every part has as many
    parts = [analyze_inputs(structures[q * n : (q + 1) * n], group, options, q * n) for q, group in enumerate(groups)]
    check_rank_order(structures, paths, len(groups))
    models, optims = [p.model for p in parts], [p.optim for p in parts]
    shapes = global_shapes(models)
    for num_parts in counts:
        check_parts_fit(shapes, num_parts, cfg_value(structures[0].get("cfg"), "model", "decoder_attention_heads"))
    return [[Source(*cut_model_parts(models, optims, shapes, num_parts, q, structures)) for q in range(num_parts)]
            for num_parts in counts]


def _part_names(options: ReshardOptions, num_parts: int, inputs: Sequence[str]) -> list[list[str]]:
    """Output names per part: `{j}` the part, `{i}` the shard."""
    name = options.output_shard_name
    if num_parts > 1 and "model_part-{j}" not in os.path.basename(name):
        raise ReshardError(
            f"--num-output-parts={num_parts} but --output-shard-name {name!r} has no 'model_part-{PART}' in its file "
            "name (the model part, as the tools read it back); e.g. 'out/checkpoint_last-model_part-{j}-shard{i}.pt'"
        )
    _check_readable(name, PART, "model part", "'...-model_part-{j}-...'")
    return [output_paths(name.replace(PART, str(q)), options.num_output_shards, inputs, overwrite=options.overwrite)
            for q in range(num_parts)]


def expand_model_parts(input_glob_pattern: str, output_shard_name: str) -> list[tuple[str, str]]:
    """(input glob, output name) per model part; `{j}` in both becomes each part number found on disk.

    Without `{j}` this is the one pair given. Part numbers keep their spelling
    (`model_part-01` stays `01`) and are ordered numerically.
    """
    in_has, out_has = PART in input_glob_pattern, PART in output_shard_name
    if not in_has and not out_has:
        return [(input_glob_pattern, output_shard_name)]
    if in_has != out_has:
        flags = ("--input-glob-pattern", "--output-shard-name")
        has, lacks = flags[::-1] if out_has else flags
        raise ReshardError(
            f"{has} has '{PART}' but {lacks} has not; put '{PART}' (the model part number) in both, e.g. "
            "'ckpts/checkpoint_last-model_part-{j}-shard*.pt' and 'out/reshard-model_part-{j}.pt'"
        )
    for pattern in pattern_forms(os.path.expanduser(input_glob_pattern)):  # a folder named `run[1]` too
        found = {digits for path in glob.glob(pattern.replace(PART, "*")) for digits in set(re.findall(r"\d+", path))
                 if fnmatch.fnmatchcase(path, pattern.replace(PART, digits))}
        if found:
            break
    if not found:
        raise ReshardError(
            f"--input-glob-pattern {input_glob_pattern!r} matches no files (with '{PART}' as a model part number)"
        )
    return [(input_glob_pattern.replace(PART, j), output_shard_name.replace(PART, j)) for j in sorted(found, key=int)]


def output_paths(output_shard_name: str, num_output_shards: int, inputs: Sequence[str], *,
                 overwrite: bool) -> list[str]:
    """`{i}` in the name (checked by `check_output_name`) becomes the output shard index; never clobber inputs."""
    outputs = [output_shard_name.replace("{i}", str(i)) for i in range(num_output_shards)]
    real_inputs = {os.path.realpath(p) for p in inputs}
    for path in outputs:
        if os.path.realpath(path) in real_inputs:
            raise ReshardError(f"--output-shard-name: {path} is also an input; write to another name")
        if os.path.isdir(path):
            raise ReshardError(f"--output-shard-name: {path} is a directory; give a file name")
        if blocker := file_in_the_way(path):
            raise ReshardError(f"--output-shard-name: {path} would be in {blocker}, which is a file, not a folder; "
                               "give a path in a folder")
    existing = [p for p in outputs if os.path.lexists(p)]  # a broken link too: no rename may replace it
    if existing and not overwrite:
        raise ReshardError(f"{summarize_paths(existing)} already exist(s); pass --overwrite to replace")
    return outputs


def check_output_name(name: str, num_output_shards: int) -> None:
    """The name (as given, `{j}` and all) must name a file, and `{i}` a shard index that reads back."""
    if os.path.basename(name) in ("", ".", ".."):  # 'out/' would write a file named 'out'
        raise ReshardError(f"--output-shard-name {name!r} names no file; give one, e.g. "
                           f"{os.path.join(name, 'reshard-model_part-0.pt')!r}")
    if unknown := sorted(set(re.findall(r"\{[^{}]*\}", name)) - {"{i}", PART}):
        raise ReshardError(f"--output-shard-name {name!r}: {unknown[0]} is not a placeholder of the name; use '{{i}}' "
                           f"(the shard index) and '{PART}' (the model part), or leave it out")
    if num_output_shards > 1 and "{i}" not in name:
        example = re.sub(r"(\.pt)?$", r"-shard{i}\1", name, count=1)
        raise ReshardError(f"--num-output-shards={num_output_shards} but --output-shard-name {name!r} has no '{{i}}'; "
                           f"add it where the shard index goes, e.g. {example!r}")
    _check_readable(name, "{i}", "shard index", "'...-shard{i}.pt'")


def _check_readable(name: str, placeholder: str, what: str, example: str) -> None:
    """Refuse digits next to a placeholder: the files' numbers could not be read back."""
    if re.search(rf"\d{re.escape(placeholder)}|{re.escape(placeholder)}\d", name):
        raise ReshardError(f"--output-shard-name {name!r}: digits next to '{placeholder}' would make the {what} "
                           f"unreadable when the files are read back; separate them, e.g. {example}")


def read_inputs(paths: Sequence[str], *, trust: bool = False) -> list[InputFile]:
    """Every input's structure, objects of unknown classes carried as `Opaque` records (nothing runs).

    Files `metaseq.torchzip` cannot read (torch's legacy format) are loaded with torch into
    memory, which needs `trust` when they hold classes outside the checkpoint format.
    """
    inputs, seen = [], {}
    for path in paths:
        try:
            stat = os.stat(path)
        except FileNotFoundError:  # gone since it was found
            raise ReshardError(f"{path}: no such file (removed, or a broken link?); give the files of one save"
                               ) from None
        other = seen.setdefault((stat.st_dev, stat.st_ino), path)
        if other != path:
            raise ReshardError(f"{other} and {path} are the same file (a link?); give each shard's own file")
        try:
            structure, found = read_checkpoint(path)
        except NeedsTorch as e:
            logger.info("%s: %s; loading it with torch, into memory", path, e)
            structure, found = from_torch(load_checkpoint(path, trust=trust))
        if not isinstance(structure, dict):
            kind = "Tensor" if is_tensor(structure) else type(structure).__name__
            raise ReshardError(f"{path}: expected a dict checkpoint, found {kind}")
        if found:
            logger.info("%s: carrying objects of %s as they are (not loaded)", path, ", ".join(found))
        inputs.append(InputFile(path, stat.st_size, stat.st_mtime_ns, structure))
    return inputs


def plan_structures(inputs: Sequence[InputFile], options: ReshardOptions, outputs: Sequence[str]) -> Plan:
    """The plan for inputs already read (ordered by shard index) into the files named `outputs`."""
    source = analyze_inputs([i.structure for i in inputs], [i.path for i in inputs], options)
    if source.optim is not None:
        check_per_rank_state(source.optim, source.model, options.num_output_shards, options.unflatten_weights)
    files = tuple(OutFile(path, r, tuple(output_tensors(source, options, r))) for r, path in enumerate(outputs))
    return _checked(Plan(options, tuple(inputs), source, files))


def _checked(plan: Plan) -> Plan:
    """The plan, once every run reads a tensor of its own and the first output assembles (carried
    values that cannot be written fail now, not halfway)."""
    read = {(run.input, run.path) for out in plan.outputs for tensor in out.tensors for run in tensor.runs}
    for index, path in read:
        src = resolve(plan.inputs[index].structure, path)
        if not is_tensor(src) or not src.is_contiguous():
            raise ReshardError(f"{plan.inputs[index].path}: {'.'.join(map(str, path))} is a view of another "
                               "tensor's storage, not a tensor of its own; such files cannot be resharded: load "
                               "it with torch, make that tensor `.contiguous()`, save it again")
    plan = replace(plan, rank_zero_only=_rank_zero_only(plan.inputs))
    if plan.outputs:
        assemble_output(plan, plan.outputs[0])
    return plan


def analyze_inputs(structures: Sequence[Mapping[str, Any]], labels: Sequence[str], options: ReshardOptions,
                   first: int = 0, *, written: bool = False) -> Source:
    """Validate the inputs (ordered by rank; `first`: input 0's index in the plan) against each other and the
    options; no tensor data is read. `written`: files this tool just wrote, so no copies of one another (two may
    hold the same bytes: shards all NaN)."""
    if not structures:
        raise ReshardError("no input shards")
    check_same_save(structures, labels)
    model = analyze_model(structures, labels, first)
    padding_only = [not any(lengths[r] for lengths in model.kept_lengths) for r in range(len(structures))]
    check_rank_order(structures, labels, copies=not written, padding_only=padding_only)  # after the layout's checks
    optim = None if options.skip_optimizer_state else analyze_optimizer(structures, model)
    if optim is not None and options.unflatten_weights and optim.num_param_groups != 1:
        raise ReshardError(
            f"{labels[0]}: {OPTIM} has {optim.num_param_groups} param groups but fairscale's consolidated "
            "layout (--unflatten-weights) supports one; pass --skip-optimizer-state"
        )
    extra_state = structures[0].get("extra_state")
    if options.drop_metaseq_req and extra_state is not None and not isinstance(extra_state, Mapping):
        raise ReshardError(f"{labels[0]}: extra_state is a {type(extra_state).__name__}, not a dict; "
                           "drop --drop-metaseq-req")
    return Source(model, optim)


def saved_at(structure: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(update, seed, run id) of the save a file comes from, where it says (`optimizer_history`, `cfg`,
    `extra_state['run_id']`, which metaseq.cli.train writes); else None."""
    extra = structure.get("extra_state")
    marks = (last_update(structure).get("num_updates"), cfg_value(structure.get("cfg"), "common", "seed"),
             extra.get("run_id") if isinstance(extra, Mapping) else None)
    return tuple(m if isinstance(m, (int, str)) else None for m in marks)  # plain values (not tensors)


def check_same_save(structures: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> None:
    """Refuse files of different saves: every file of a checkpoint is saved at the same update of one run (seed,
    and run id where the files have one)."""
    (updates, seed, run), name = saved_at(structures[0]), labels[0]
    for structure, label in zip(structures[1:], labels[1:]):
        theirs = saved_at(structure)
        if theirs[0] != updates:
            raise ReshardError(f"{label} was saved at update {theirs[0]} but {name} at update {updates}: the files "
                               "come from different saves (one cut short?); use the files of one complete save")
        if theirs[1] != seed:
            raise ReshardError(f"{label} comes from a run with seed {theirs[1]} but {name} from seed {seed}: the "
                               "files mix two training runs; use one run's files")
        if None not in (run, theirs[2]) and theirs[2] != run:
            raise ReshardError(f"{label} comes from training run {theirs[2]} but {name} from run {run} (their "
                               "extra_state['run_id'], though seed and update agree): the files mix two training "
                               "runs; use one run's files")


def check_rank_order(structures: Sequence[Mapping[str, Any]], labels: Sequence[str], parts: int = 1, *,
                     copies: bool = True, padding_only: Sequence[bool] = ()) -> None:
    """Refuse files out of the order of the ranks that saved them, where the files say (cfg's distributed_rank, as
    training and the reshard tools write it; older resharded files all say 0): `structures` part by part, shard i
    of part j saved by rank i * parts + j (fairscale's model-parallel layout). Else, with `copies`, refuse copies
    among the files but those `padding_only` (ranks past a small model's elements: alike, and all a copy could be)."""
    ranks = [cfg_value(s.get("cfg"), "distributed_training", "distributed_rank") for s in structures]
    if len(set(ranks)) == 1 or not all(type(r) is int for r in ranks):
        held = [(s, label) for s, label, empty in itertools.zip_longest(structures, labels, padding_only) if not empty]
        return _check_not_copies(*zip(*held)) if len(held) > 1 and copies else None
    first = {}
    for rank, label in zip(ranks, labels):
        if first.setdefault(rank, label) != label:
            raise ReshardError(f"{label} and {first[rank]} were both saved by rank {rank} (their cfg's "
                               "distributed_rank): one is a copy of the other; use the files of one save")
    n = len(ranks) // parts
    order = sorted(range(len(ranks)), key=lambda t: (t % n) * parts + t // n)  # by the rank each name says
    for t, expected in zip(order, sorted(ranks)):
        if ranks[t] != expected:
            raise ReshardError(f"{labels[t]} was saved by rank {ranks[t]} (its cfg's distributed_rank) but its name "
                               f"says rank {expected}: the files were renamed or swapped; give them back the names "
                               "training wrote")


def _check_not_copies(structures: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> None:
    """Files that do not say which rank saved them: refuse two whose tensors hold the same bytes (a shard copied
    under another's name). The first bytes of each storage tell files apart; files alike there are read in full."""
    seen: dict[tuple, list[tuple[str, list[Storage]]]] = {}
    for structure, label in zip(structures, labels):
        storages = list({id(t.storage): t.storage for t in tensors_in(structure) if t.storage.nbytes}.values())
        key = tuple((s.nbytes, s.read(0, min(s.nbytes, 4096))) for s in storages)
        for other, theirs in seen.get(key, []) if storages else ():
            if all(a.same_bytes(b) for a, b in zip(storages, theirs)):
                raise ReshardError(f"{label} and {other} hold the same bytes (their cfg does not say which rank saved "
                                   "each): one is a copy of the other; use the files of one save")
        seen.setdefault(key, []).append((label, storages))


def output_tensors(source: Source, options: ReshardOptions, rank: int) -> list[OutTensor]:
    """Every tensor of output shard `rank`: its shape, dtype and the input runs to copy."""
    model, targets = source.model, []
    kept = next((fp.key for fp in model.flat_params if not fp.flattened), None)
    if options.num_output_shards == 1 and not options.unflatten_weights and kept is not None:
        raise ReshardError(f"--num-output-shards=1: FSDP at world size 1 keeps the parameters of flatten_parameters="
                           f"False instances (such as '{kept}') in their own shapes, not flat; write 2 or more shards, "
                           "or pass --unflatten-weights")
    cuts = output_cuts(model, options.unflatten_weights, options.num_output_shards, rank)
    for held in model.dicts:  # the model, then its EMA copies: cut like it, never cast
        cast = options.dtype if held.root == ("model",) else None
        targets += [OutTensor((*held.root, key), shape, _cast(held.dtypes[k], cast), plan_range(held.sources[k], a, b))
                    for _, k, key, a, b, shape in cuts]
        targets += [whole_tensor((*held.root, e.key), (*held.root, e.actual_key), e.shape, e.dtype, cast, model.first)
                    for e in held.extras if e.shape is not None]  # buffers: copied (compact) from input 0 (its part's)
    return targets + (optimizer_targets(source.optim, cuts) if source.optim is not None else [])


def whole_tensor(path: tuple, source: tuple, shape: Size, dtype: DType, cast: DType | None = None,
                 input: int = 0) -> OutTensor:
    """Output tensor `path`: all of input `input`'s tensor at `source` (of `shape`), cast to `cast` if floating."""
    n = shape.numel()
    return OutTensor(path, shape, _cast(dtype, cast), (Run(input, source, 0, 0, n),) if n else ())


def _cast(dtype: DType, output_dtype: DType | None) -> DType:
    return output_dtype if output_dtype is not None and dtype.is_floating_point else dtype


def tensor_ref(tensor: OutTensor, inputs: Sequence[InputFile]) -> TensorRef:
    """A new tensor whose storage is filled from the runs' bytes in the inputs (cast where dtypes differ)."""
    out, itemsize = TensorRef.empty(tensor.shape, tensor.dtype), tensor.dtype.itemsize
    for run in tensor.runs:
        src = resolve(inputs[run.input].structure, run.path)  # contiguous: checked while planning
        source, offset = src.storage.locate(src.storage_offset + run.start)
        out.storage.copies.append(Copy(source, offset, run.offset * itemsize, run.length, src.dtype, run.count,
                                       run.stride * src.dtype.itemsize, run.pitch * itemsize))
    return out


def assemble_output(plan: Plan, out: OutFile) -> dict[str, Any]:
    """Output `out`'s object: fresh compact tensors, every other top-level key from input 0 (of its model part when
    the parts stay as they are)."""
    source, options = out.source or plan.source, plan.options
    model, first = source.model, plan.inputs[source.model.first]
    tensors = {t.path: tensor_ref(t, plan.inputs) for t in out.tensors}
    result: dict[str, Any] = {}
    for key, value in first.structure.items():
        if key == "model":
            result[key] = _assemble_dict(model, model.dicts[0], options, value, tensors)
        elif key == "shard_metadata":  # unflattened: one shard, no padding
            cuts = output_cuts(model, False, options.num_output_shards, out.rank)
            result[key] = output_metadata(model, [s.numel() - (end - start) for *_, start, end, s in cuts])
        elif key == OPTIM and options.skip_optimizer_state:
            continue
        elif key == OPTIM and source.optim is not None and options.unflatten_weights:
            result[key] = assemble_consolidated_optimizer(value, source.optim, model, tensors)
        elif key == OPTIM and source.optim is not None:
            result[key] = assemble_flat_optimizer(value, source.optim, model, tensors, out.rank)
        elif key == "extra_state" and isinstance(value, Mapping):
            extra = result[key] = dict(value)
            for held in model.dicts[1:]:  # the mirrors (EMA): cut like the model
                extra[held.root[1]] = _assemble_dict(model, held, options, value[held.root[1]], tensors)
            iterator = extra.get("train_iterator")
            if options.drop_metaseq_req:
                extra["train_iterator"] = None
            elif (out.rank or out.part) and plan.rank_zero_only and isinstance(iterator, Mapping):  # on output 0 alone
                extra["train_iterator"] = {**iterator, **dict.fromkeys(plan.rank_zero_only)}
        elif key == "cfg" and cfg_fields(value) is not None:
            result[key] = _cfg_for_output(value, options, out, first.path)
        else:
            result[key] = value
    if options.drop_metaseq_req and result.get("extra_state") is None:
        result["extra_state"] = {"train_iterator": None}
    return result


def _assemble_dict(model: ModelLayout, held: ParamDict, options: ReshardOptions, value0: Mapping[str, Any],
                   tensors: dict) -> dict:
    """`held` (input 0's is `value0`) with this output's tensors; an OrderedDict stays one, with its modules' versions
    (`_metadata`, keyed by the flat layout's module names) in flat outputs."""
    out: dict[str, Any] = collections.OrderedDict() if isinstance(value0, collections.OrderedDict) else {}
    if hasattr(value0, "_metadata") and not options.unflatten_weights:
        out._metadata = value0._metadata
    for fp in model.flat_params:
        for key in fp.names if options.unflatten_weights else (fp.key,):
            out[key] = tensors[(*held.root, key)]
    for src, dst in (*(model.ties if options.unflatten_weights else ()), *held.aliases):  # the same tensor: saved
        out[dst] = out[src]  # once, loaded as a tie
    for extra in held.extras:
        out[extra.key] = tensors[(*held.root, extra.key)] if extra.shape is not None else value0[extra.actual_key]
    return out


def _rank_zero_only(inputs: Sequence[InputFile]) -> tuple[str, ...]:
    """The keys of data loader state that only input 0 holds (upstream's tokenization cache: None on the other
    ranks): they stay on output 0 alone, rather than being copied into every output."""
    extras = [i.structure.get("extra_state") for i in inputs]
    iterators = [e.get("train_iterator") if isinstance(e, Mapping) else None for e in extras]
    if len(iterators) < 2 or not all(isinstance(t, Mapping) for t in iterators):
        return ()
    first, theirs = iterators[0], iterators[1:]
    return tuple(k for k, v in first.items() if v is not None and all(k in t and t[k] is None for t in theirs))


def _cfg_for_output(cfg: Any, options: ReshardOptions, out: OutFile, path0: str) -> Any:
    """Input 0's cfg (`path0` its file) with this output's place, in the fields it has: the world size, the rank
    (shard i of part j is rank i * parts + j, fairscale's layout) and, with new parts, their number and suffix."""
    parts, part = options.num_output_parts, out.part
    if parts is None:  # reshard_fsdp: the parts stay as they are
        declared = cfg_value(cfg, "common", "model_parallel_size")
        parts = declared if type(declared) is int and declared > 0 else 1
        part = model_part_number(path0) or 0
    updates = {("distributed_training", "distributed_world_size"): parts * options.num_output_shards}
    if part < parts:
        updates["distributed_training", "distributed_rank"] = out.rank * parts + part
    if options.num_output_parts is not None:
        updates["common", "model_parallel_size"] = parts  # added where absent, to dict sections
        updates["model", "model_parallel_size"] = parts  # upstream's model args have it too
        updates["checkpoint", "checkpoint_suffix"] = f"-model_part-{part}"
    result = dict(cfg) if isinstance(cfg, Mapping) else copy.deepcopy(cfg)  # what was read stays as it is
    top = cfg_fields(result)
    for (section, field), value in updates.items():
        if top is None or cfg_fields(top.get(section)) is None:
            continue
        if isinstance(cfg, Mapping):  # its sections are input 0's own
            top[section] = copy.deepcopy(top[section])
        fields = cfg_fields(top[section])
        node = fields.get(field)
        if is_omegaconf(node) and "_val" in node.state:  # a value node
            node.state["_val"] = value
        elif field in fields or (section, field) == ("common", "model_parallel_size") and not isinstance(
                top[section], Opaque):
            fields[field] = value
    return result


def summarize_plan(plan: Plan) -> str:
    """`8 shard(s) -> 2 flat shard(s); optimizer state kept; dtype unchanged`."""
    opts = plan.options
    form = "unflattened" if opts.unflatten_weights else "flat"
    src = "1 unflattened input" if plan.source.model.unflattened else f"{len(plan.inputs)} shard(s)"
    optim = "dropped" if opts.skip_optimizer_state else ("kept" if plan.source.optim else "none")
    dtype = opts.dtype.name if opts.dtype else "unchanged"
    out = f"{opts.num_output_shards} {form} shard(s)"
    if opts.num_output_parts is not None:
        src, out = f"{len(plan.inputs)} file(s) of all model parts", f"{opts.num_output_parts} part(s) x {out}"
    return f"{src} -> {out}; optimizer state {optim}; dtype {dtype}"


def describe_plan(plan: Plan) -> list[str]:
    """Human-readable plan: inputs, N -> M, per output its tensor bytes and the input ranges it reads."""
    lines = [f"inputs ({len(plan.inputs)}):"] + [f"  {i.path}" for i in plan.inputs]
    lines.append(f"plan: {summarize_plan(plan)}")
    for out in plan.outputs:
        name = f"part {out.part} shard {out.rank}" if plan.options.num_output_parts is not None else out.rank
        lines.append(f"output {name}: {out.path} ({out.nbytes} bytes of tensors)")
        lines += _reads(plan.inputs, out.tensors)
    return lines


def _reads(inputs: Sequence[InputFile], tensors: Sequence[OutTensor], limit: int = 4) -> list[str]:
    """A line per input read: the model tensors and [start, end) element ranges read from it."""
    spans: dict[int, dict[str, list[int]]] = {}
    for t in tensors:
        for r in t.runs:
            if r.path[0] != "model":
                continue
            last = r.start + (r.count - 1) * r.stride + r.length
            span = spans.setdefault(r.input, {}).setdefault(r.path[-1], [r.start, last])
            span[0], span[1] = min(span[0], r.start), max(span[1], last)
    lines = []
    for index in sorted(spans):
        items = [f"{key}[{lo}:{hi})" for key, (lo, hi) in spans[index].items()]
        more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
        lines.append(f"  reads {inputs[index].path}: {', '.join(items[:limit])}{more}")
    return lines
