"""Export a metaseq checkpoint as a Hugging Face OPT folder.

    python -m metaseq.scripts.convert_to_hf --input out/reshard-model_part-0.pt --output hf_model
"""
from __future__ import annotations

import argparse
import logging

from metaseq.cli_logging import REMOVED, OneLineErrorParser, run_cli
from metaseq.cli_start import run_as_main
from metaseq.hf import convert_to_hf

__all__ = ["build_parser", "main"]

logger = logging.getLogger("metaseq.scripts.convert_to_hf")

EPILOG = """\
examples:
  # a consolidated file (reshard_fsdp --unflatten-weights True, or convert_from_hf's output)
  python -m metaseq.scripts.convert_to_hf --input out/reshard-model_part-0.pt --output hf_model

  # raw training shards of one model part, consolidated on the fly (quote the glob)
  python -m metaseq.scripts.convert_to_hf \\
    --input "ckpts/checkpoint_last-model_part-0-shard*.pt" --output hf_model --overwrite

then, offline:
  from transformers import OPTForCausalLM, AutoTokenizer
  model = OPTForCausalLM.from_pretrained("hf_model"); tok = AutoTokenizer.from_pretrained("hf_model")

DIR gets config.json, generation_config.json, model.safetensors (weights bit-identical, same
dtype, lm_head tied) and, for this project's byte vocabulary, tokenizer.json and
tokenizer_config.json. Checkpoints written before the OPT-exact model change and OPT-350m's
variant are refused, and so are model-parallel parts (merge them first:
reshard_model_parallel --num-output-parts 1) and a DIR that holds an input or the current
folder. Optimizer state is not exported.
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m metaseq.scripts.convert_to_hf",
        description="Write a Hugging Face OPT folder (OPTForCausalLM) from a metaseq checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, metavar="PATH_OR_GLOB",
                   help="a consolidated .pt file, a quoted glob of one model part's raw shard files, or the name "
                        "of a save as training takes it (DIR/checkpoint_last.pt: its shards)")
    p.add_argument("--output", required=True, metavar="DIR", help="the folder to write (parents are created)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it exists and is not empty (it may hold only a model folder's files: "
                   "weights, configs, tokenizer)")
    p.add_argument("--trust-checkpoint", action="store_true", help="allow arbitrary pickles (trusted files only)")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return p


def _run(args: argparse.Namespace) -> None:
    convert_to_hf(args.input, args.output, overwrite=args.overwrite, trust_checkpoint=args.trust_checkpoint)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; 0 on success, 2 on any error (one line on stderr)."""
    return run_cli(logger, build_parser(), argv, _run, stopped=REMOVED)


if __name__ == "__main__":
    run_as_main(main)
