"""`--verify`: check the inputs' CRC32s before writing, then the written outputs against the inputs.

    check_input_checksums(plan)          # every byte of every input, before anything is written
    write_outputs(jobs, crc32=True)      # the same writer as always, storing CRC32s of what it wrote
    report = verify_reshard_outputs(plan)  # "verified 3 outputs: 52 parameters, ..."

The outputs' records are checked against the CRC32s the writer stored, then compared with
`metaseq.reshard.compare` in its strict mode: both sides read per original parameter
(inputs cast like `--output-dtype`), dtypes must match and bits must be identical.
Cost: one more read of the inputs and two of the outputs.
"""
from __future__ import annotations

import logging
from typing import Sequence

from metaseq.errors import CheckpointLoadError, ReshardError
from metaseq.file_io import check_checkpoint_crc
from metaseq.reshard.compare import Comparison, compare_tensor_sets, tensor_set_from_source
from metaseq.reshard.layout import ModelLayout
from metaseq.reshard.options import ReshardOptions
from metaseq.reshard.plan import Plan, Source, analyze_inputs, read_inputs
from metaseq.reshard.ranges import shard_range
from metaseq.reshard.write import remove_outputs

__all__ = ["check_input_checksums", "verify_reshard_outputs"]

logger = logging.getLogger(__name__)


def check_input_checksums(plan: Plan) -> int:
    """Read every input in full and check each record against its zip CRC32; returns bytes checked.

    torch.load does not do this, so without it a flipped bit in tensor data passes unnoticed.
    """
    paths = [i.path for i in plan.inputs]
    checked = [check_checkpoint_crc(path, tensors=True) or 0 for path in paths]
    unchecked = [path for path, n in zip(paths, checked) if n == 0]
    if unchecked:
        logger.warning(
            "%d input(s) carry no CRC32s (legacy format, or saved without checksums), e.g. %s: "
            "a flipped bit in their tensor data cannot be noticed", len(unchecked), unchecked[0]
        )
    logger.info("inputs match their CRC32 checksums (%d file(s), %d bytes)", len(plan.inputs), sum(checked))
    return sum(checked)


def verify_reshard_outputs(plan: Plan) -> str:
    """Re-open the outputs and check them against the inputs; returns the report line.

    Checked: the outputs form the planned checkpoint (M flat shards padded as FSDP pads
    them, or one unflattened file) with the inputs' parameter names, shapes and ties;
    every parameter, buffer and per-element optimizer state is bit-identical to the
    inputs'; optimizer scalars (step) and settings (param_groups, loss_scale) are equal.
    On any failure the outputs are removed (they cannot be trusted) and ReshardError names
    the first culprit.
    """
    paths = [out.path for out in plan.outputs]
    try:
        return _verify(plan, paths)
    except (ReshardError, CheckpointLoadError) as e:
        remove_outputs(paths)
        raise ReshardError(f"--verify failed, outputs removed: {e}") from None
    except BaseException:
        remove_outputs(paths)
        raise


def _verify(plan: Plan, paths: Sequence[str]) -> str:
    for path in paths:
        check_checkpoint_crc(path, tensors=True)
    counts = [0, 0, 0, 0]  # parameters, buffers, optimizer tensors, optimizer scalars
    compared = False
    for part in sorted({out.part for out in plan.outputs}):  # model parts: each against its planned cut
        outs = [out for out in plan.outputs if out.part == part]
        result, buffers = _verify_part(plan, outs[0].source or plan.source, [out.path for out in outs])
        counts = [a + b for a, b in zip(counts, (result.model_tensors - buffers, buffers, result.optimizer_tensors,
                                                  result.optimizer_scalars))]
        compared = result.optimizer_compared
    report = (f"verified {len(paths)} output(s): {counts[0]} parameters, {counts[1]} buffers, "
              f"{counts[2]} optimizer tensors bit-identical to the inputs")
    if compared:
        report += f", {counts[3]} optimizer scalars and the optimizer settings equal"
    return report + "; metadata consistent"


def _verify_part(plan: Plan, planned: Source, paths: Sequence[str]) -> tuple[Comparison, int]:
    """One model part's outputs against the inputs they were planned from."""
    outs = read_inputs(paths, trust=plan.options.trust_checkpoint)
    source = analyze_inputs([o.structure for o in outs], list(paths), ReshardOptions())
    _check_form(plan, planned.model, source.model, paths)
    if (source.optim is None) != (planned.optim is None):
        state = "has" if source.optim is not None else "lacks"
        raise ReshardError(f"{paths[0]} {state} optimizer state, unlike the plan")
    inputs = tensor_set_from_source(planned, plan.inputs, plan.options.output_dtype)
    outputs = tensor_set_from_source(source, outs)
    result = compare_tensor_sets(inputs, outputs, exact_dtype=True)
    if not result.equal:
        first = result.differences[0]
        raise ReshardError(
            f"{len(result.differences)} difference(s) between the outputs and the inputs, "
            f"first {first.name}: {first.detail}"
        )
    return result, len(outputs.buffers)


def _check_form(plan: Plan, ref: ModelLayout, out: ModelLayout, paths: Sequence[str]) -> None:
    """Same parameters as planned (`ref`), in the planned form, each output rank padded as FSDP pads it."""
    opts = plan.options
    if out.unflattened != opts.unflatten_weights:
        form = "unflattened" if out.unflattened else "flat"
        raise ReshardError(f"{paths[0]} is {form}, unlike the plan")
    if len(out.flat_params) != len(ref.flat_params) or out.ties != ref.ties:
        raise ReshardError(f"{paths[0]}: flat parameters or ties differ from the inputs' metadata")
    for mine, theirs in zip(out.flat_params, ref.flat_params):
        if (mine.key, mine.names, mine.shapes) != (theirs.key, theirs.names, theirs.shapes):
            raise ReshardError(f"{paths[0]}: flat parameter '{mine.key}' differs from the inputs' metadata")
    if not opts.unflatten_weights:
        _check_paddings(out, paths, opts.num_output_shards)


def _check_paddings(out: ModelLayout, paths: Sequence[str], world_size: int) -> None:
    for k, fp in enumerate(out.flat_params):
        for rank, path in enumerate(paths):
            start, end, padded_len = shard_range(fp.numel, world_size, rank)
            found = (out.padded_lengths[k][rank], out.kept_lengths[k][rank])
            if found != (padded_len, end - start):
                raise ReshardError(
                    f"{path}: '{fp.key}' holds {found[1]} of {found[0]} elements, expected {end - start} of {padded_len}"
                )
