"""Turn a Hugging Face OPT folder into metaseq raw FSDP shards (to train on) or one consolidated file.

    python -m metaseq.scripts.convert_from_hf --input hf_model \\
      --output-shard-name "ckpts/checkpoint_last-model_part-0-shard{i}.pt" --num-output-shards 4
"""
from __future__ import annotations

import argparse
import logging

from metaseq.cli_logging import REMOVED, OneLineErrorParser, add_bool_flag, run_cli
from metaseq.cli_start import run_as_main
from metaseq.hf import convert_from_hf

__all__ = ["build_parser", "main"]

logger = logging.getLogger("metaseq.scripts.convert_from_hf")

EPILOG = """\
examples:
  # 4 raw FSDP shards, then keep training on 4 ranks (Adam starts from scratch)
  python -m metaseq.scripts.convert_from_hf --input hf_model \\
    --output-shard-name "ckpts/checkpoint_last-model_part-0-shard{i}.pt" --num-output-shards 4
  python -m metaseq.cli.train --data corpus.txt --save-dir ckpts --world-size 4 \\
    --max-update 100 --restore-file ckpts/checkpoint_last.pt

  # one consolidated file for metaseq.cli.interactive_cli or reshard_fsdp
  python -m metaseq.scripts.convert_from_hf --input hf_model \\
    --output-shard-name out/reshard-model_part-0.pt --num-output-shards 1 --unflatten-weights True

DIR holds config.json and model.safetensors or pytorch_model.bin (or a sharded
model.safetensors.index.json or pytorch_model.bin.index.json and its files); weight names may or may not start with 'model.'; an lm_head must equal the
token embedding. Weights keep their bytes and dtype. Refused, with nothing written: a missing
config.json or weights, weights of several dtypes (fp16 with fp32 LayerNorms), untied heads,
activations other than ReLU, post-LayerNorm (OPT-350m, word_embed_proj_dim != hidden_size)
and models without biases or LayerNorm weights.
"""

def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m metaseq.scripts.convert_from_hf",
        description="Write metaseq raw FSDP shards (or one consolidated file) from a Hugging Face OPT folder.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, metavar="DIR", help="a Hugging Face OPT model folder")
    p.add_argument("--output-shard-name", required=True, metavar="NAME",
                   help="output file name; with more than one shard it must contain {i}, the shard index")
    p.add_argument("--num-output-shards", type=int, default=1, metavar="M",
                   help="FSDP world size to write for (default: 1)")
    add_bool_flag(p, "unflatten-weights", "write one consolidated file with parameter names (needs --num-output-shards 1)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return p


def _run(args: argparse.Namespace) -> None:
    convert_from_hf(args.input, args.output_shard_name, num_output_shards=args.num_output_shards,
                    unflatten_weights=args.unflatten_weights, overwrite=args.overwrite)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; 0 on success, 2 on any error (one line on stderr)."""
    return run_cli(logger, build_parser(), argv, _run, stopped=REMOVED)


if __name__ == "__main__":
    run_as_main(main)
