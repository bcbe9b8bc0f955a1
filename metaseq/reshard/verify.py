"""`--verify`: check the inputs' CRC32s before writing, then the written outputs against the inputs.

    check_input_checksums(plan)          # every byte of every input, before anything is written
    write_outputs(jobs, crc32=True)      # the same writer as always, storing CRC32s of what it wrote
    report = verify_reshard_outputs(plan)  # "verified 3 outputs: 52 parameters, ..."

The outputs' records are checked against the CRC32s the writer stored, their metadata against
the plan (form, names, shapes, ties, FSDP's padding), then they are compared with
`metaseq.reshard.compare` in its strict mode: both sides read per original parameter
(inputs cast like `--output-dtype`), dtypes must match and bits must be identical.
Cost: one more read of the inputs and two of the outputs.
"""
from __future__ import annotations

import logging
from collections import Counter

from metaseq.errors import CheckpointLoadError, ReshardError
from metaseq.file_io import check_checkpoint_crc
from metaseq.reshard.compare import compare_tensor_sets, tensor_set_from_source
from metaseq.reshard.layout import all_ties
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.plan import Plan, analyze_inputs, read_inputs
from metaseq.reshard.ranges import shard_range
from metaseq.reshard.write import remove_outputs

__all__ = ["check_input_checksums", "verify_reshard_outputs"]

logger = logging.getLogger(__name__)


def check_input_checksums(plan: Plan) -> int:
    """Read every input in full and check each record against its zip CRC32 (torch.load does not); returns bytes."""
    found = [check_checkpoint_crc(i.path, tensors=True) or (0, i.size) for i in plan.inputs]
    unchecked = [i.path for i, (_, without) in zip(plan.inputs, found) if without]
    if unchecked:
        logger.warning("%d input(s) carry no CRC32s for some or all of their data (legacy format, saved without "
                       "checksums, or written by reshard_fsdp without --verify), e.g. %s: a flipped bit there cannot "
                       "be noticed", len(unchecked), unchecked[0])
    checked = sum(n for n, _ in found)
    logger.info("inputs match their CRC32 checksums (%d file(s), %d bytes)", len(plan.inputs), checked)
    return checked


def verify_reshard_outputs(plan: Plan) -> str:
    """Re-open the outputs and check them against the inputs; returns the report line.

    On any failure the outputs are removed (they cannot be trusted) and ReshardError names the first culprit.
    """
    paths = [out.path for out in plan.outputs]
    try:
        for path in paths:
            check_checkpoint_crc(path, tensors=True)
        total = sum((_verify_part(plan, part) for part in sorted({out.part for out in plan.outputs})), Counter())
    except BaseException as e:
        remove_outputs(paths)
        if isinstance(e, (ReshardError, CheckpointLoadError)):
            raise ReshardError(f"--verify failed, outputs removed: {e}") from None
        raise
    report = (f"verified {len(paths)} output(s): {total['parameters']} parameters, {total['buffers']} buffers, "
              f"{total['tensors']} optimizer tensors bit-identical to the inputs")
    if total["optimizer"]:
        report += f", {total['scalars']} optimizer scalars and the optimizer settings equal"
    return report + "; metadata consistent"


def _verify_part(plan: Plan, part: int) -> Counter:
    """One model part's outputs against the inputs they were planned from: first their metadata (the planned
    parameters and ties, in the planned form, each flat rank padded as FSDP pads it), then every value."""
    outs, opts = [out for out in plan.outputs if out.part == part], plan.options
    planned, paths = outs[0].source or plan.source, [out.path for out in outs]
    files = read_inputs(paths, trust=opts.trust_checkpoint)
    found = analyze_inputs([f.structure for f in files], paths, ReshardOptions(), written=True)
    ours, theirs = ((form, [(fp.key, fp.names, fp.shapes) for fp in s.model.flat_params], all_ties(s.model),
                     s.optim is None)
                    for form, s in ((found.model.unflattened, found), (opts.unflatten_weights, planned)))
    facts = ("form", "flat parameters", "ties", "optimizer state")
    differ = [what for what, a, b in zip(facts, ours, theirs) if a != b]
    if differ:
        raise ReshardError(f"{paths[0]}: its {' and '.join(differ)} differ from the plan")
    out = found.model
    for k, fp in enumerate(out.flat_params if not opts.unflatten_weights else ()):  # FSDP's padding, rank by rank
        for rank, (path, padded, kept) in enumerate(zip(paths, out.padded_lengths[k], out.kept_lengths[k])):
            start, end, padded_len = shard_range(fp.numel, opts.num_output_shards, rank)
            if (padded, kept) != (padded_len, end - start):
                raise ReshardError(f"{path}: '{fp.key}' holds {kept} of {padded} elements, "
                                   f"expected {end - start} of {padded_len}")
    inputs = tensor_set_from_source(planned, plan.inputs, opts.output_dtype, stored_ties=outs[0].source is None)
    outputs = tensor_set_from_source(found, files)
    result = compare_tensor_sets(inputs, outputs, exact_dtype=True)
    if not result.equal:
        first = result.differences[0]
        raise ReshardError(f"{len(result.differences)} difference(s) between the outputs and the inputs, "
                           f"first {first.name}: {first.detail}")
    buffers = len(outputs.buffers)
    return Counter(parameters=result.model_tensors - buffers, buffers=buffers, tensors=result.optimizer_tensors,
                   scalars=result.optimizer_scalars, optimizer=result.optimizer_compared)
