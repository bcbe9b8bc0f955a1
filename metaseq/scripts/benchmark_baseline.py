"""The benchmark's reference contenders, as processes of their own so they are timed like the tool.

    python -m metaseq.scripts.benchmark_baseline load-save \\
        --input-glob-pattern 'ckpt/checkpoint_last-model_part-0-shard*.pt' --output-dir copies/
    python -m metaseq.scripts.benchmark_baseline load-everything \\
        --input-glob-pattern 'ckpt/checkpoint_last-model_part-0-shard*.pt' --output out/shard0.pt

`benchmark_reshard` runs these; see docs/performance.md.
"""
from __future__ import annotations

import argparse
import glob
import logging

from metaseq.benchmark.reference import load_and_save, load_everything_reshard
from metaseq.cli_start import run_as_main
from metaseq.file_io import natural_sort_key

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m metaseq.scripts.benchmark_baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("mode", choices=["load-save", "load-everything"])
    parser.add_argument("--input-glob-pattern", required=True)
    parser.add_argument("--output-dir", help="load-save: folder for the copies")
    parser.add_argument("--output", help="load-everything: the consolidated file")
    parser.add_argument("--real-structured", action="store_true",
                        help="the inputs are benchmark_reshard --real-structured files: load them trusting the "
                             "pickle, with upstream's LockingArray stood in")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    needed = "--output-dir" if args.mode == "load-save" else "--output"
    if getattr(args, needed.lstrip("-").replace("-", "_")) is None:
        parser.error(f"{args.mode} needs {needed}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    args = parse_args(argv)
    paths = sorted(glob.glob(args.input_glob_pattern), key=natural_sort_key)
    if not paths:
        logger.error("--input-glob-pattern %s matches no files", args.input_glob_pattern)
        return 1
    if args.mode == "load-save":
        load_and_save(paths, args.output_dir, real_structured=args.real_structured)
    else:
        load_everything_reshard(paths, args.output, real_structured=args.real_structured)
    return 0


if __name__ == "__main__":
    run_as_main(main)
