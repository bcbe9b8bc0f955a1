"""Reshard fairscale FSDP checkpoints of one model part: N shards -> M shards, or one unflattened file.

    python -m metaseq.scripts.reshard_fsdp \\
      --input-glob-pattern "ckpts/checkpoint_last-model_part-0-shard*.pt" \\
      --output-shard-name "out/reshard-model_part-0.pt" \\
      --num-output-shards 1 --skip-optimizer-state True --unflatten-weights True
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

from metaseq.cli_logging import REMOVED, OneLineErrorParser, add_bool_flag, positive_int, run_cli
from metaseq.cli_start import run_as_main
from metaseq.reshard import ReshardError, ReshardOptions, describe_plan, reshard, reshard_fsdp_checkpoints
from metaseq.reshard.distributed import World, detect_world
from metaseq.reshard.options import DTYPES

__all__ = ["ReshardError", "build_parser", "main", "reshard_fsdp_checkpoints"]

# Named explicitly: under `python -m` __name__ is "__main__", outside the "metaseq" logger main() configures.
logger = logging.getLogger("metaseq.scripts.reshard_fsdp")

EPILOG = """\
examples:
  # 8 training shards -> 1 inference file with original parameter names
  python -m metaseq.scripts.reshard_fsdp \\
    --input "ckpts/checkpoint_last-model_part-0-shard*.pt" \\
    --output "out/reshard-model_part-0.pt" \\
    --num-output-shards 1 --skip-optimizer-state True --unflatten-weights True

  # 8 training shards -> 2 training shards (optimizer state resharded too)
  python -m metaseq.scripts.reshard_fsdp \\
    --input "ckpts/checkpoint_last-model_part-0-shard*.pt" \\
    --output "ckpts2/checkpoint_last-model_part-0-shard{i}.pt" --num-output-shards 2

  # an unflattened file back to 4 training shards, in fp16, showing the plan only
  python -m metaseq.scripts.reshard_fsdp --input out/reshard-model_part-0.pt \\
    --output "ckpts4/checkpoint_last-model_part-0-shard{i}.pt" --num-output-shards 4 \\
    --output-dtype fp16 --dry-run

  # every model part ({j}) to 64 shards, on 2 nodes x 8 processes: rank r writes the
  # (part, shard) jobs r, r + 16, ... (under Slurm: srun ... python -m metaseq.scripts.reshard_fsdp ...)
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
    -m metaseq.scripts.reshard_fsdp \\
    --input "ckpts/checkpoint_last-model_part-{j}-shard*.pt" \\
    --output "ckpts64/checkpoint_last-model_part-{j}-shard{i}.pt" --num-output-shards 64 --num-workers 1

speed and memory: the tool reads the inputs' pickles itself and copies each tensor's bytes
file to file (copy_file_range), without holding tensors: about the speed of cp, about
20 MiB of memory. --output-dtype casts chunk by chunk on the way (torch is imported for
it); --verify stores CRC32s in the outputs, then re-reads and compares them. Files in
torch's legacy (non-zip) format are loaded with torch into memory. --num-workers K
writes K outputs at once, in K threads (default: one per CPU).
"""

TRUST_HELP = ("only for inputs in torch's legacy (non-zip) format, which torch.load reads: let it load classes outside "
              "the checkpoint format, which can run code, so only for files you trust. Other inputs never need it: "
              "objects of any class are carried without being loaded")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m metaseq.scripts.reshard_fsdp",
        description="Reshard the FSDP checkpoint shards of one model part into any number of shards, "
        "or consolidate them into one file with original parameter names.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--input-glob-pattern", "--input", dest="input_glob_pattern", required=True,
                        help="glob of the input shards of ONE model part (quote it), or one consolidated file; "
                        "'{j}' (also in --output-shard-name) stands for every model part found")
    parser.add_argument("--output-shard-name", "--output", dest="output_shard_name", required=True,
                        help="output file name; '{i}' is replaced by the output shard index, '{j}' by the model part")
    parser.add_argument("--num-output-shards", type=int, default=1, help="number of output shards M (default 1)")
    add_bool_flag(parser, "skip-optimizer-state", "drop last_optimizer_state from the outputs")
    add_bool_flag(parser, "unflatten-weights", "write original parameter names and shapes (needs M = 1)")
    parser.add_argument("--output-dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point model weights and buffers (never optimizer state); refused "
                        "where a finite value would become inf (beyond fp16's +-65504)")
    parser.add_argument("--drop-metaseq-req", action="store_true",
                        help="set extra_state['train_iterator'] to None (the data position)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    parser.add_argument("--verify", action="store_true",
                        help="check the inputs' CRC32s before writing, then re-read the outputs and check every "
                        "tensor is bit-identical to the inputs (reads the inputs twice more, the outputs once)")
    parser.add_argument("--torch-io", action="store_true",
                        help="deprecated, no effect: every output is written by the same byte-copying writer")
    parser.add_argument("--num-workers", type=positive_int, default=None, metavar="K",
                        help="write K output files at once, in K threads (default: one per CPU, at most one "
                        "per output)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    return parser


def _run(args: argparse.Namespace, world: World | None) -> int:
    if args.torch_io:
        logger.warning("--torch-io has no effect any more (every output is written the same way); "
                       "it will be removed in release 0.3")
    return run_reshard(args, world)


def run_reshard(args: argparse.Namespace, world: World | None) -> int:
    """Reshard as the flags (`ReshardOptions` fields) say; with --dry-run, rank 0 prints the plan."""
    plans = reshard(ReshardOptions.from_fields(vars(args)), world=world)
    if args.dry_run and (world is None or world.rank == 0):
        print("\n".join(line for plan in plans for line in describe_plan(plan)))  # the answer, on stdout
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 on success and 2 on any error (reported as one line on stderr)."""
    return run_main(build_parser(), argv, _run)


def run_main(parser: argparse.ArgumentParser, argv: list[str] | None,
             action: Callable[[argparse.Namespace, World | None], int]) -> int:
    """The reshard CLIs' `main`: parse, find the launcher's world (only rank 0 logs progress), run `action`; any
    error, SIGTERM (torchrun stopping the other ranks) or Ctrl-C is one line, this run's outputs removed."""
    def run(args: argparse.Namespace) -> int:
        world = detect_world()
        if world is not None and world.rank != 0:
            logging.getLogger("metaseq").setLevel(logging.WARNING)  # `run_cli` restores it
        return action(args, world)

    return run_cli(logger, parser, argv, run, stopped=REMOVED)


if __name__ == "__main__":
    run_as_main(main)
