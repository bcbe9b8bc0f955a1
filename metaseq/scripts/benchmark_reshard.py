"""Benchmark `metaseq.scripts.reshard_fsdp` on synthetic checkpoints against cp and load+save.

    python -m metaseq.scripts.benchmark_reshard --size-gb 2 \\
        --scenarios 8-1,8-16,1-8,16-3,8-1u --out results.json
    python -m metaseq.scripts.benchmark_reshard --size-gb 0.05 --scenarios 256-1,1-256
    python -m metaseq.scripts.benchmark_reshard --size-gb 2 --real-structured   # upstream OPT shards' structure
    python -m metaseq.scripts.benchmark_reshard --plot docs/performance.png   # needs the bench extra

Prints a Markdown table (seconds, GB/s, ratio to each baseline, peak RSS and
peak anonymous RSS against the memory bound, pass/fail per target) and writes
the same as JSON with --out. See docs/performance.md for the method and targets.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from metaseq.benchmark import runner, synth
from metaseq.cli_logging import OneLineErrorParser, positive_float, positive_int, run_cli
from metaseq.cli_start import run_as_main
from metaseq.errors import UserError

logger = logging.getLogger("metaseq.scripts.benchmark_reshard")  # not __main__ under -m

TOOL_MODULE = "metaseq.scripts.reshard_fsdp"
DEFAULT_SCENARIOS = "8-1,8-16,1-8,16-3,8-1u"
DEFAULT_PLOT_SIZES = "0.25,0.5,1,2,4"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m metaseq.scripts.benchmark_reshard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--size-gb", type=positive_float, default=2.0,
                        help="total size of all input shard files, model + optimizer state (default 2)")
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                        help="comma list of N-M (flat) and N-1u (unflattened) reshards, PxN-QxM model-parallel ones "
                             "(P parts of N shards into Q parts of M); a +fp16, +bf16 or +verify suffix adds "
                             f"--output-dtype or --verify (default {DEFAULT_SCENARIOS})")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--workdir", help="folder for the synthetic checkpoints (default: a temp dir)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the synthetic checkpoints (and the temp workdir) afterwards")
    parser.add_argument("--layers", type=positive_int, default=12,
                        help="decoder layers of the synthetic model (default 12)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before every run (root only); default: warm cache")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="runs per contender; the fastest time and the highest memory count (default 1)")
    parser.add_argument("--per-file-limit-s", type=positive_float, default=runner.PER_FILE_LIMIT_S,
                        help="time target of scenarios with more than 64 shards on a side (default 10)")
    parser.add_argument("--timeout-s", type=positive_float, default=None, help="kill any single run after this long")
    parser.add_argument("--real-structured", action="store_true",
                        help="structure the inputs like upstream metaseq's OPT shards: Namespace cfg, int steps, "
                             "loss_scale, 2 optimizer_history entries, and rank 0's tokenization cache pickled as "
                             "metaseq.data.document_to_sequence.LockingArray (a class this package lacks)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--plot", metavar="PNG",
                        help="instead of the scenarios: time and memory of 8-1 vs load-everything over --plot-sizes")
    parser.add_argument("--plot-sizes", default=DEFAULT_PLOT_SIZES, help=f"GB sizes for --plot ({DEFAULT_PLOT_SIZES})")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Check what argparse cannot, before anything runs; a UserError names the flag."""
    try:
        args.scenario_list = runner.parse_scenarios(args.scenarios)
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        args.sizes = [positive_float(s) for s in args.plot_sizes.split(",") if s.strip()]
    except (ValueError, argparse.ArgumentTypeError):
        raise UserError(f"--plot-sizes {args.plot_sizes!r}: expected positive GB sizes such as 0.25,0.5,1") from None
    if args.out and (os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out)))):
        raise UserError(f"--out {args.out}: not a file in an existing folder; give e.g. results.json")
    if args.out:  # found before the runs, not after them
        _check_writable(os.path.dirname(os.path.abspath(args.out)), f"--out {args.out}")
    if args.workdir and os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        raise UserError(f"--workdir {args.workdir} is a file; give a folder (made if needed)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install -e '.[bench]'")


def _check_writable(folder: str, what: str) -> None:
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UserError(f"{what}: cannot write in {folder} ({e.strerror}); give a writable path") from None


def machine_info(folder: Path) -> dict[str, Any]:
    """CPUs, RAM, and the file system the benchmark wrote to."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    disk = shutil.disk_usage(folder)
    return {
        "cpus": os.cpu_count(),
        "mem_total_bytes": int(meminfo["MemTotal"].split()[0]) * 1024,
        "disk": _mount_of(folder.resolve()),
        "disk_total_bytes": disk.total,
        "disk_free_bytes": disk.free,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _mount_of(path: Path) -> str:
    """`device on mount point (fstype)` of the mount holding `path`, from /proc/mounts."""
    mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    inside = [m for m in mounts if path.is_relative_to(m[1])]
    device, mount_point, fstype = max(inside, key=lambda m: len(m[1]))
    return f"{device} on {mount_point} ({fstype})"


def run_scenarios(config: runner.BenchConfig) -> tuple[dict[str, Any], bool]:
    baselines, results = runner.run_benchmark(config)
    sys.stdout.write(runner.format_table(baselines, results) + "\n")
    report = {
        "baselines": [asdict(b) for b in baselines],
        "scenarios": [r.to_dict() for r in results],
        "passed": all(r.passed for r in results),
    }
    return report, all(r.returncode == 0 for r in results)


def run_plot(config: runner.BenchConfig, sizes: list[float], png: str) -> tuple[dict[str, Any], bool]:
    from metaseq.benchmark.plot import plot_sweep  # matplotlib only here

    points = runner.run_size_sweep(sizes, config)
    plot_sweep(points, png)
    logger.info("wrote %s", png)
    ran = all(p.tool.returncode == 0 and p.reference.returncode == 0 for p in points)
    report = {"sweep": [asdict(p) for p in points], "plot": png,
              "passed": ran and all(p.tool.peak_anon <= p.memory_bound for p in points)}
    return report, ran


def main(argv: list[str] | None = None) -> int:
    return run_cli(logger, build_parser(), argv, _run)


def _run(args: argparse.Namespace) -> int:
    check_args(args)
    if importlib.util.find_spec(TOOL_MODULE) is None:
        raise UserError(f"{TOOL_MODULE} is not importable; install the package (pip install -e .) first")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="benchmark_reshard-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--workdir {workdir}: cannot create it ({e.strerror}); give a writable folder") from None
    _check_writable(str(workdir), f"--workdir {workdir}")
    config = runner.BenchConfig(
        args.size_gb, args.scenario_list, workdir, layers=args.layers, drop_caches=args.drop_caches,
        repeats=args.repeat, keep_inputs=args.keep, per_file_limit_s=args.per_file_limit_s,
        timeout_s=args.timeout_s, real_structured=args.real_structured,
    )
    try:
        _check_sizes(config, args.sizes if args.plot else None)  # before anything is written
        report, ran = run_plot(config, args.sizes, args.plot) if args.plot else run_scenarios(config)
    except (ValueError, RuntimeError) as e:  # a too small size, or a baseline that failed
        logger.error("%s", e)
        return 1
    finally:
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    report.update(size_gb=args.size_gb, real_structured=args.real_structured, repeat=args.repeat,
                  cache="dropped" if args.drop_caches else "warm",
                  machine=machine_info(workdir if workdir.exists() else workdir.parent), limits=_limits(args))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    if not ran:
        return 1
    return 1 if args.check and not report["passed"] else 0


def _check_sizes(config: runner.BenchConfig, sweep_sizes: list[float] | None) -> None:
    """Raise ValueError (naming the flag) when a size is too small for its shard count."""
    if sweep_sizes is None:
        runner.plan_inputs(config)
        return
    try:
        synth.plan_model_config(int(min(sweep_sizes) * runner.GB), runner.SWEEP_SCENARIO.inputs, layers=config.layers,
                                real_structured=config.real_structured)
    except ValueError as e:
        raise ValueError(str(e).replace("--size-gb", "--plot-sizes")) from None


def _limits(args: argparse.Namespace) -> dict[str, float]:
    return {"load_save_factor": runner.LOAD_SAVE_FACTOR, "copy_factor": runner.COPY_FACTOR,
            "slack_bytes": runner.SLACK_BYTES, "many_files": runner.MANY_FILES,
            "per_file_limit_s": args.per_file_limit_s}


if __name__ == "__main__":
    run_as_main(main)
