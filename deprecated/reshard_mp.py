#!/usr/bin/env python3
"""DEPRECATED: the old `reshard_mp` command line, kept until release 0.3 is out.

Despite its name, `reshard_mp` never changed model parallelism. It reshards the
FSDP shards of ONE model part to a new data-parallel size, keeping weights flat:

    {save_prefix}-model_part-{part}-shard*.pt -> {save_dir}/reshard-model_part-{part}-shard{i}.pt

for i < --target-ddp-size. This script has no resharding code of its own: it
builds the equivalent `python -m metaseq.scripts.reshard_fsdp` command, logs it
(copy it into your scripts), and runs that tool's `main()` with it. Like the old
tool, it replaces existing output files. Example:

    python deprecated/reshard_mp.py ckpts/checkpoint_last out --part 0 --target-ddp-size 8

Upstream's later `reshard_mp.py` did change model parallelism, of consolidated files
(model weights only); that form is forwarded to `metaseq.scripts.reshard_model_parallel`:

    python deprecated/reshard_mp.py --input "out/reshard-model_part-*.pt" \
        --output "mp/reshard-model_part-{i}.pt" --num-output-parts 2
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import warnings
from pathlib import Path

REMOVED_AFTER = "0.3"
NEW_TOOL = "metaseq.scripts.reshard_fsdp"
MP_TOOL = "metaseq.scripts.reshard_model_parallel"
UPSTREAM_FLAGS = ("--input", "--output", "--num-output-parts", "--num_output_parts")
# The words reshard_fsdp's `--flag BOOL` takes. Not imported from there: this script must
# start, and warn, without importing torch (the launchers call it once per part to warn).
TRUE_WORDS = {"true", "1", "yes", "y", "on"}
FALSE_WORDS = {"false", "0", "no", "n", "off"}

logger = logging.getLogger("deprecated.reshard_mp")


def parse_bool(text: str) -> bool:
    """`True`/`False` in any case (also 1/0, yes/no), as the old fire-based CLI took them."""
    word = text.strip().lower()
    if word not in TRUE_WORDS | FALSE_WORDS:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return word in TRUE_WORDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python deprecated/reshard_mp.py",
        description=(
            f"DEPRECATED (removed after release {REMOVED_AFTER}): reshard the FSDP shards of one model part. "
            f"Forwards to python -m {NEW_TOOL}, which is what you should call instead."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=("upstream metaseq's later form, which changes the number of model parts of consolidated files: "
                "python deprecated/reshard_mp.py --input 'DIR/reshard-model_part-*.pt' --output "
                f"'OUT/reshard-model_part-{{i}}.pt' --num-output-parts Q (forwarded to python -m {MP_TOOL})"),
    )
    p.add_argument("save_prefix", help="inputs are {save_prefix}-model_part-{part}-shard*.pt, e.g. ckpts/checkpoint_last")
    p.add_argument("save_dir", help="outputs are {save_dir}/reshard-model_part-{part}-shard{i}.pt")
    given = dict(default=argparse.SUPPRESS)  # defaults in `main`, once the two forms are merged (ints there too:
    # argparse would pass SUPPRESS itself to the type of an optional positional)
    p.add_argument("positional_part", nargs="?", metavar="PART", help="as --part (the old tool's order)", **given)
    p.add_argument("positional_size", nargs="?", metavar="TARGET_DDP_SIZE", help="as --target-ddp-size", **given)
    p.add_argument("--part", help="model-parallel part whose shards to reshard (default 0)", **given)
    p.add_argument("--target-ddp-size", "--target_ddp_size", help="number of output shards (default 512)", **given)
    bool_flag = dict(nargs="?", const=True, default=False, type=parse_bool, metavar="True|False")
    p.add_argument(
        "--no-pad", "--no_pad", **bool_flag,
        help="accepted and ignored: outputs are always padded like FSDP pads them, so that FSDP can load them",
    )
    p.add_argument(
        "--drop-optimizer-state", "--drop_optimizer_state", **bool_flag,
        help="write no optimizer state (the new tool's --skip-optimizer-state)",
    )
    p.add_argument(
        "--print-replacement", action="store_true",
        help="print the equivalent reshard_fsdp command and exit without resharding",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The old command line: PART and TARGET_DDP_SIZE as flags or, as the old tool took them, positionally."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, positional, default in (("part", "positional_part", 0), ("target_ddp_size", "positional_size", 512)):
        if hasattr(args, name) and hasattr(args, positional):
            parser.error(f"--{name.replace('_', '-')} given twice: as a flag and as a positional argument")
        value = getattr(args, name, getattr(args, positional, default))
        try:
            setattr(args, name, int(value))
        except ValueError:
            parser.error(f"--{name.replace('_', '-')}={value}: expected a whole number")
    if args.part < 0:
        parser.error(f"--part={args.part} must be 0 or more")
    if args.target_ddp_size < 1:
        parser.error(f"--target-ddp-size={args.target_ddp_size} must be at least 1")
    return args


def _keeps_optimizer_state(args: argparse.Namespace) -> bool:
    """Whether the old tool wrote optimizer state: not dropped, and in the input's first shard (read without torch;
    an unreadable shard is left for the new tool to report)."""
    if args.drop_optimizer_state:
        return False
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled checkout finds its own metaseq
    from metaseq.torchzip import read_checkpoint

    try:
        structure, _ = read_checkpoint(f"{args.save_prefix}-model_part-{args.part}-shard0.pt")
    except Exception:  # noqa: BLE001 -- missing, legacy or damaged: the new tool says which
        return True
    return isinstance(structure, dict) and structure.get("last_optimizer_state") is not None


def replacement_argv(args: argparse.Namespace) -> list[str]:
    """The `reshard_fsdp` arguments that do what the old tool did with `args`. Its names: `-shard{i}`, but one file
    `reshard-model_part-J.pt` at --target-ddp-size 1 when it wrote optimizer state (OPT's serving recipes use it)."""
    one_file = args.target_ddp_size == 1 and _keeps_optimizer_state(args)
    name = f"reshard-model_part-{args.part}.pt" if one_file else f"reshard-model_part-{args.part}-shard{{i}}.pt"
    argv = [
        "--input-glob-pattern", f"{args.save_prefix}-model_part-{args.part}-shard*.pt",
        "--output-shard-name", os.path.join(args.save_dir, name),
        "--num-output-shards", str(args.target_ddp_size),
        "--overwrite",  # the old tool replaced existing outputs without asking
    ]
    if args.drop_optimizer_state:
        argv.append("--skip-optimizer-state")
    return argv


def build_upstream_parser() -> argparse.ArgumentParser:
    """Upstream metaseq's later form: consolidated parts in, consolidated parts out, weights only."""
    p = argparse.ArgumentParser(
        prog="python deprecated/reshard_mp.py",
        description=(f"DEPRECATED (removed after release {REMOVED_AFTER}): change the number of model parts of "
                     f"consolidated files. Forwards to python -m {MP_TOOL}, which is what you should call instead."),
    )
    p.add_argument("--input", required=True, help="glob of the parts' consolidated files (quote it)")
    p.add_argument("--output", required=True, help="output name; '{i}' (or '{j}') is the model part")
    p.add_argument("--num-output-parts", "--num_output_parts", type=int, default=1, help="model parts Q")
    return p


def upstream_replacement_argv(args: argparse.Namespace) -> list[str]:
    """The `reshard_model_parallel` arguments that do what upstream's reshard_mp did."""
    return ["--input-glob-pattern", args.input, "--output-shard-name", args.output.replace("{i}", "{j}"),
            "--num-output-parts", str(args.num_output_parts), "--num-output-shards", "1",
            "--unflatten-weights", "True", "--skip-optimizer-state", "True", "--overwrite"]


def replacement_command(argv: list[str], tool: str = NEW_TOOL) -> str:
    """A complete, copy-pasteable shell command."""
    return shlex.join(["python", "-m", tool, *argv])


def warn_deprecated(argv: list[str], tool: str = NEW_TOOL) -> None:
    command = replacement_command(argv, tool)
    logger.warning(
        "deprecated/reshard_mp.py is deprecated and will be removed after release %s; "
        "it now runs this command, use it instead:\n    %s",
        REMOVED_AFTER, command,
    )
    warnings.warn(
        f"deprecated/reshard_mp.py will be removed after release {REMOVED_AFTER}; "
        f"use python -m {tool} (the exact command is in the log above)",
        DeprecationWarning,
        stacklevel=2,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    if any(a.split("=", 1)[0] in UPSTREAM_FLAGS for a in argv):
        return _main_upstream(argv)
    args = parse_args(argv)
    new_argv = replacement_argv(args)
    if args.print_replacement:
        print(replacement_command(new_argv))
        return 0
    warn_deprecated(new_argv)
    if args.no_pad:
        logger.warning(
            "--no-pad is ignored: outputs are padded exactly as FSDP pads its flat parameters, "
            "so that FSDP can load them; the padding is a few zeros per flat parameter"
        )
    # Imported only now: the deprecation notice comes first even if the import is slow or fails.
    # A checkout that was not installed still finds its own metaseq package.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from metaseq.scripts import reshard_fsdp

    return reshard_fsdp.main(new_argv)


def _main_upstream(argv: list[str]) -> int:
    args = build_upstream_parser().parse_args(argv)
    new_argv = upstream_replacement_argv(args)
    warn_deprecated(new_argv, MP_TOOL)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from metaseq.scripts import reshard_model_parallel

    return reshard_model_parallel.main(new_argv)


if __name__ == "__main__":
    sys.exit(main())
