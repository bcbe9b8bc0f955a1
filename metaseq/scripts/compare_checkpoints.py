"""Do two checkpoints hold the same model? Any sharding on either side, flat or unflattened, any model parts.

    python -m metaseq.scripts.compare_checkpoints \\
      "ckpts/checkpoint_last-model_part-0-shard*.pt" out/reshard-model_part-0.pt

Exit status: 0 the same, 1 different, 2 an error. Tensors are read one parameter at a
time from mmap-loaded files (no FSDP, no process group).
"""
from __future__ import annotations

import argparse
import logging

from metaseq.cli_logging import OneLineErrorParser, run_cli
from metaseq.cli_start import run_as_main
from metaseq.errors import ReshardError, UserError
from metaseq.file_io import find_model_parts, find_shards, glob_files, model_part_number
from metaseq.reshard.compare import (TensorSet, compare_tensor_sets, describe_comparison, open_model_parts,
                                     open_tensor_set)

__all__ = ["build_parser", "main"]

logger = logging.getLogger("metaseq.scripts.compare_checkpoints")

EPILOG = """\
examples:
  # did resharding 8 training shards into 2 change anything (optimizer state included)?
  python -m metaseq.scripts.compare_checkpoints \\
    "ckpts/checkpoint_last-model_part-0-shard*.pt" "ckpts2/checkpoint_last-model_part-0-shard*.pt"

  # an fp16 inference file against the fp32 training shards, weights only
  python -m metaseq.scripts.compare_checkpoints \\
    "ckpts/checkpoint_last-model_part-0-shard*.pt" out/reshard-model_part-0.pt \\
    --skip-optimizer-state --atol 1e-3

  # two model parts against the one part reshard_model_parallel merged them into
  python -m metaseq.scripts.compare_checkpoints \\
    "ckpts/checkpoint_last-model_part-*-shard*.pt" "merged/checkpoint_last-model_part-0-shard*.pt"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m metaseq.scripts.compare_checkpoints",
        description="Say whether two checkpoints hold the same model (and optimizer state, if both have it), "
        "listing each differing tensor with its max abs difference. A glob over several model parts "
        "('model_part-*', or '{j}') is compared as the whole model, its cut parameters merged.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("a", metavar="A", help="glob of FSDP shards (quote it) or one file")
    parser.add_argument("b", metavar="B", help="glob of FSDP shards (quote it) or one file")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="largest abs difference still counted as equal (default 0: equal values, NaN "
                             "equal to NaN, 0.0 to -0.0)")
    parser.add_argument("--skip-optimizer-state", action="store_true", help="compare model tensors only")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="let torch.load run the classes of inputs in torch's legacy (non-zip) format; "
                        "trusted files only (other inputs never need it)")
    parser.add_argument("--quiet", action="store_true", help="print only the verdict line")
    return parser


def _open(pattern: str, side: str, **options: bool) -> TensorSet:
    """The checkpoint `pattern` matches: one model part's files, or every part's ('model_part-*' or '{j}')."""
    try:
        pattern = pattern.replace("{j}", "*")
        if len({model_part_number(path) for path in glob_files(pattern)}) > 1:
            return open_model_parts(find_model_parts(pattern, flag="pattern"), **options)
        return open_tensor_set(find_shards(pattern, flag="pattern"), **options)
    except UserError as e:
        raise ReshardError(f"{side}: {e}") from None


def _run(args: argparse.Namespace) -> int:
    if not args.atol >= 0:  # nan too
        raise ReshardError(f"--atol={args.atol}: must be a number at least 0")
    options = dict(trust=args.trust_checkpoint, skip_optimizer_state=args.skip_optimizer_state)
    a, b = _open(args.a, "A", **options), _open(args.b, "B", **options)
    comparison = compare_tensor_sets(a, b, atol=args.atol)
    lines = describe_comparison(comparison, a, b)
    print("\n".join(lines[-1:] if args.quiet else lines))  # the CLI's answer, on stdout
    return 0 if comparison.equal else 1


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 the same, 1 different, 2 an error (one line on stderr)."""
    return run_cli(logger, build_parser(), argv, _run, level=logging.WARNING)


if __name__ == "__main__":
    run_as_main(main)
