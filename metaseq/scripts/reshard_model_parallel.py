"""Change the number of model-parallel parts of a checkpoint (and its FSDP shards per part) in one pass.

    python -m metaseq.scripts.reshard_model_parallel \\
      --input-glob-pattern "ckpts/checkpoint_last-model_part-*-shard*.pt" \\
      --output-shard-name "out/checkpoint_last-model_part-{j}-shard{i}.pt" \\
      --num-output-parts 1 --num-output-shards 8

The same planner and writer as `reshard_fsdp`: parameters are cut by the partition
rules in `metaseq.models.partition` and their bytes copied, optimizer state included.
"""
from __future__ import annotations

import argparse

from metaseq.cli_logging import OneLineErrorParser, add_bool_flag, positive_int
from metaseq.cli_start import run_as_main
from metaseq.reshard.options import DTYPES
from metaseq.scripts.reshard_fsdp import TRUST_HELP, run_main, run_reshard

__all__ = ["build_parser", "main"]


EPILOG = """\
examples:
  # 2 parts x 4 training shards -> 1 part x 8 shards, optimizer state included (resume on 8 GPUs)
  python -m metaseq.scripts.reshard_model_parallel \\
    --input "ckpts/checkpoint_last-model_part-*-shard*.pt" \\
    --output "ckpts8/checkpoint_last-model_part-{j}-shard{i}.pt" --num-output-parts 1 --num-output-shards 8

  # 2 parts x 4 shards -> one file for chat (interactive_cli --path chat/reshard-model_part-0.pt)
  python -m metaseq.scripts.reshard_model_parallel \\
    --input "ckpts/checkpoint_last-model_part-*-shard*.pt" --output "chat/reshard-model_part-{j}.pt" \\
    --num-output-parts 1 --num-output-shards 1 --unflatten-weights True --skip-optimizer-state True

  # 1 part -> 4 parts of 2 shards, to train a bigger model on 8 GPUs (--model-parallel-size 4)
  python -m metaseq.scripts.reshard_model_parallel \\
    --input "ckpts/checkpoint_last-model_part-0-shard*.pt" \\
    --output "mp4/checkpoint_last-model_part-{j}-shard{i}.pt" --num-output-parts 4 --num-output-shards 2

inputs: P parts x N raw FSDP shards (one glob for all parts), or P consolidated files
(reshard-model_part-*.pt as reshard_fsdp --unflatten-weights writes them). Parameters are
cut as fairscale's tensor-parallel layers cut them: vocabulary and column-parallel weights
on dim 0 (a fused qkv_proj block by block), row-parallel weights on dim 1, everything else
replicated (taken from part 0, with a warning if the parts differ). Q must divide what each
part holds equally; the error says which Q would. Speed and memory as reshard_fsdp: bytes
are copied file to file, one output at a time per writer thread.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m metaseq.scripts.reshard_model_parallel",
        description="Reshard a model-parallel checkpoint to another number of model parts and FSDP shards.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--input-glob-pattern", "--input", dest="input_glob_pattern", required=True,
                        help="glob of every part's shards ('*' or '{j}' for the part number), or of the parts' "
                        "consolidated files (quote it)")
    parser.add_argument("--output-shard-name", "--output", dest="output_shard_name", required=True,
                        help="output file name: '{j}' the model part, '{i}' the shard")
    parser.add_argument("--num-output-parts", type=positive_int, required=True, metavar="Q",
                        help="model-parallel parts Q of the outputs")
    parser.add_argument("--num-output-shards", type=int, default=1, metavar="M",
                        help="FSDP shards M per part (default 1)")
    add_bool_flag(parser, "skip-optimizer-state", "drop last_optimizer_state from the outputs")
    add_bool_flag(parser, "unflatten-weights", "write original parameter names and shapes, one file per part (M = 1)")
    parser.add_argument("--output-dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point model weights and buffers (never optimizer state); refused "
                        "where a finite value would become inf (beyond fp16's +-65504)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    parser.add_argument("--verify", action="store_true",
                        help="store CRC32s in the outputs, then re-read them and check every tensor against the inputs")
    parser.add_argument("--num-workers", type=positive_int, default=None, metavar="K",
                        help="write K output files at once, in K threads (default: one per CPU)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; 0 on success, 2 on any error (one line on stderr), as `reshard_fsdp.main`."""
    return run_main(build_parser(), argv, run_reshard)


if __name__ == "__main__":
    run_as_main(main)
