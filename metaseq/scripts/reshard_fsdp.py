"""Reshard fairscale FSDP checkpoints of one model part: N shards -> M shards, or one unflattened file.

    python -m metaseq.scripts.reshard_fsdp \\
      --input-glob-pattern "ckpts/checkpoint_last-model_part-0-shard*.pt" \\
      --output-shard-name "out/reshard-model_part-0.pt" \\
      --num-output-shards 1 --skip-optimizer-state True --unflatten-weights True
"""
from __future__ import annotations

import argparse
import logging
import sys

from metaseq.file_io import CheckpointLoadError
from metaseq.reshard.build import DTYPES, consolidate_shards, reshard_shards
from metaseq.reshard.driver import describe_reshard_plan, plan_reshard_fsdp, reshard_fsdp_checkpoints
from metaseq.reshard.schema import ReshardError

__all__ = ["ReshardError", "consolidate_shards", "main", "reshard_fsdp_checkpoints", "reshard_shards"]

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
"""

TRUE_WORDS = {"true", "1", "yes", "y", "on"}
FALSE_WORDS = {"false", "0", "no", "n", "off"}


class _Parser(argparse.ArgumentParser):
    """Argument errors become one-line ReshardErrors (main reports them like any other error)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ReshardError(f"{message} (see --help)")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _add_bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    """`--name`, `--name True/False` (true/false/1/0/yes/no) and `--no-name`."""
    dest = name.replace("-", "_")
    parser.add_argument(
        f"--{name}", dest=dest, nargs="?", const=True, default=False, type=parse_bool, metavar="BOOL", help=help_text
    )
    parser.add_argument(f"--no-{name}", dest=dest, action="store_false", help=f"same as --{name} False")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m metaseq.scripts.reshard_fsdp",
        description="Reshard the FSDP checkpoint shards of one model part into any number of shards, "
        "or consolidate them into one file with original parameter names.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--input-glob-pattern", "--input", dest="input_glob_pattern", required=True,
                        help="glob of the input shards of ONE model part (quote it), or one consolidated file")
    parser.add_argument("--output-shard-name", "--output", dest="output_shard_name", required=True,
                        help="output file name; '{i}' is replaced by the output shard index")
    parser.add_argument("--num-output-shards", type=int, default=1, help="number of output shards M (default 1)")
    _add_bool_flag(parser, "skip-optimizer-state", "drop last_optimizer_state from the outputs")
    _add_bool_flag(parser, "unflatten-weights", "write original parameter names and shapes (needs M = 1)")
    parser.add_argument("--output-dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point model weights and buffers (never optimizer state)")
    parser.add_argument("--drop-metaseq-req", action="store_true",
                        help="set extra_state['train_iterator'] to None (the data position)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="allow arbitrary pickled objects in the inputs (trusted files only)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    return parser


def _run(args: argparse.Namespace) -> int:
    kwargs = dict(
        num_output_shards=args.num_output_shards,
        unflatten_weights=args.unflatten_weights,
        skip_optimizer_state=args.skip_optimizer_state,
        output_dtype=args.output_dtype,
        drop_metaseq_req=args.drop_metaseq_req,
        overwrite=args.overwrite,
        trust_checkpoint=args.trust_checkpoint,
    )
    if args.dry_run:
        plan = plan_reshard_fsdp(args.input_glob_pattern, args.output_shard_name, **kwargs)
        print("\n".join(describe_reshard_plan(plan)))  # the CLI's answer, on stdout
        return 0
    reshard_fsdp_checkpoints(args.input_glob_pattern, args.output_shard_name, **kwargs)
    return 0


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    if isinstance(err, (ReshardError, CheckpointLoadError, OSError)):
        return text
    return f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 on success and 2 on any error (reported as one line on stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    package_logger = logging.getLogger("metaseq")
    saved = (package_logger.level, package_logger.propagate)
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    try:
        args = build_parser().parse_args(argv)
        if args.quiet:
            package_logger.setLevel(logging.WARNING)
        return _run(args)
    except Exception as err:  # noqa: BLE001 -- any error: one line, no traceback
        logger.error("%s", _one_line(err))
        return 2
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(saved[0])
        package_logger.propagate = saved[1]


if __name__ == "__main__":
    sys.exit(main())
