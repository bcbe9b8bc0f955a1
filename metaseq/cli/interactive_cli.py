"""Ask a checkpoint questions, one prompt per line, without FSDP.

On a terminal it shows a `> ` prompt; piped, it answers every input line and exits:

    echo "what is the meaning of life?" | \\
        python -m metaseq.cli.interactive_cli --path demo_out/reshard_1/reshard-model_part-0.pt

`--path` is a consolidated file or raw shards (a glob, or a stem such as
`DIR/checkpoint_last.pt`), consolidated in memory. A real OPT checkpoint (upstream
metaseq's cfg) also needs its GPT-2 BPE: `--vocab-filename gpt2-vocab.json
--merges-filename gpt2-merges.txt`, or `--hf-tokenizer DIR`. Answers go to stdout, one line
each (empty for a prompt that failed; with --no-stop-at-newline an answer keeps its newlines, so it
may span lines); logs and errors go to stderr. Ctrl-D (EOF) exits; empty lines are
ignored. Ctrl-C quits (status 130); SIGTERM, or Ctrl-C while the model loads, ends it with
one error line (status 2 or 130), never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Iterator, TextIO

from metaseq.cli_logging import (OneLineErrorParser, Terminated, handlers_restored, ignore_stops, sigterm_raises,
                                 stop_status)
from metaseq.cli_start import run_as_main
from metaseq.errors import UserError
from metaseq.hf.tokenization import BPETokenizer, TextTokenizer
from metaseq.hub_utils import GenerationConfig, GeneratorInterface, InferenceLoadError

logger = logging.getLogger("metaseq.cli.interactive_cli")

PROMPT = "> "


def build_parser() -> argparse.ArgumentParser:
    d = GenerationConfig
    p = OneLineErrorParser(
        prog="python -m metaseq.cli.interactive_cli",
        description="Generate completions from a consolidated checkpoint or raw FSDP shards.",
        epilog='example: echo "what is the meaning of life?" | python -m metaseq.cli.interactive_cli '
        "--path demo_out/reshard_1/reshard-model_part-0.pt; a real OPT file: --path opt/reshard-model_part-0.pt "
        "--vocab-filename gpt2-vocab.json --merges-filename gpt2-merges.txt",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--path", required=True, default=argparse.SUPPRESS,  # no "(default: None)" in --help
                   help="consolidated file, shard glob, or stem such as DIR/checkpoint_last.pt")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="at most this many tokens per answer")
    p.add_argument("--sampling", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=d.temperature, help="with --sampling")
    p.add_argument("--top-p", type=float, default=d.top_p, help="with --sampling: nucleus mass to keep")
    p.add_argument("--seed", type=int, default=d.seed, help="with --sampling")
    p.set_defaults(stop_at_newline=True)  # the flag's own default is suppressed: help would say "(default: True)"
    p.add_argument("--no-stop-at-newline", dest="stop_at_newline", action="store_false", default=argparse.SUPPRESS,
                   help="continue past newlines (an answer stops at the first newline by default); stop only at EOS, "
                   "so an answer may span lines")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="let torch.load run the classes of legacy-format (non-zip) files; trusted files only")
    p.add_argument("--vocab-filename", default=None, type=os.path.expanduser,
                   help="real OPT: metaseq's GPT-2 BPE vocabulary (gpt2-vocab.json)")
    p.add_argument("--merges-filename", default=None, type=os.path.expanduser,
                   help="real OPT: the GPT-2 BPE merges (gpt2-merges.txt)")
    p.add_argument("--hf-tokenizer", default=None, type=os.path.expanduser, metavar="DIR",
                   help="a Hugging Face tokenizer folder (tokenizer.json)")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading details to stderr")
    return p


def generation_config_from_args(args: argparse.Namespace) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=args.sampling,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_at_newline=args.stop_at_newline,
    )


def read_prompts(stream: TextIO, *, interactive: bool) -> Iterator[str]:
    """Non-empty stripped lines until EOF; on a terminal each is read after a `> ` prompt."""
    while True:
        if interactive:
            try:
                line = input(PROMPT)
            except EOFError:
                print()  # leave the shell prompt on a fresh line after Ctrl-D
                return
        else:
            line = stream.readline()
            if not line:
                return
        line = line.strip()
        if line:
            yield line


def answer_prompts(gen: GeneratorInterface, cfg: GenerationConfig, prompts: Iterator[str], out: TextIO) -> int:
    """Write one stripped completion per prompt (an empty line for a prompt that failed, so that answers stay on the
    lines of their prompts, unless a completion holds newlines: see --no-stop-at-newline); returns how many prompts
    failed."""
    failures = 0
    for number, prompt in enumerate(prompts, start=1):
        try:
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:  # bytes stdin could not decode (kept as surrogates)
                raise ValueError(f"prompt {number} is not UTF-8 text; give prompts in UTF-8") from None
            (completion,) = gen.generate([prompt], cfg)
        except ValueError as e:  # e.g. a prompt longer than the model's context
            logger.error("%s", e)
            failures += 1
            completion = ""
        print(completion.strip(), file=out, flush=True)
    return failures


def configure_logging(verbose: bool) -> logging.Handler:
    """Log `metaseq.*` to stderr (errors only unless --verbose); returns the handler to remove.

    A handler on the package logger rather than `basicConfig`, so that `main()` called
    in-process (tests, notebooks) reports exactly like the command line.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    package = logging.getLogger("metaseq")
    package.addHandler(handler)
    package.setLevel(logging.INFO if verbose else logging.WARNING)
    package.propagate = False
    return handler


def build_tokenizer(args: argparse.Namespace) -> TextTokenizer | None:
    """The tokenizer the flags name; None: the byte tokenizer (checkpoints of this project)."""
    if (args.vocab_filename is None) != (args.merges_filename is None):
        given, needed = ("--vocab-filename", "--merges-filename")[:: 1 if args.vocab_filename else -1]
        raise ValueError(f"{given} needs {needed} too (GPT-2 BPE takes both files)")
    if args.vocab_filename and args.hf_tokenizer:
        raise ValueError("pass either --vocab-filename/--merges-filename or --hf-tokenizer, not both")
    if args.vocab_filename:
        return BPETokenizer.from_vocab_merges(args.vocab_filename, args.merges_filename)
    if args.hf_tokenizer:
        return BPETokenizer.from_hf_folder(args.hf_tokenizer)
    return None


def run(args: argparse.Namespace) -> int:
    cfg = generation_config_from_args(args)
    try:
        cfg.validate()
        default = GenerationConfig()
        if not cfg.sampling and (ignored := [f"--{name.replace('_', '-')}" for name in ("temperature", "top_p", "seed")
                                             if getattr(cfg, name) != getattr(default, name)]):
            logger.warning("%s: ignored without --sampling (the argmax is taken); add --sampling to sample",
                           ", ".join(ignored))
        tokenizer = build_tokenizer(args)
        gen = GeneratorInterface.from_checkpoint(args.path, trust=args.trust_checkpoint, tokenizer=tokenizer)
    except (ValueError, UserError, InferenceLoadError) as e:
        logger.error("%s", e)
        return 2
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 become one prompt's error, not a traceback
        sys.stdin.reconfigure(encoding="utf-8", errors="surrogateescape")
    if interactive:
        _enable_line_editing()
    try:
        failures = answer_prompts(gen, cfg, read_prompts(sys.stdin, interactive=interactive), sys.stdout)
    except KeyboardInterrupt:  # at the prompt or while answering: the user quits
        ignore_stops()
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `| head -1` closed stdout early; not an error
        sys.stdout = None  # nothing left to flush at exit
        return 0
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UserError as e:  # a bad flag: one line, as every other error
        print(f"{logger.name}: ERROR: {e}", file=sys.stderr)
        return 2
    package = logging.getLogger("metaseq")
    saved = package.level, package.propagate
    handler = configure_logging(args.verbose)
    try:
        with handlers_restored(), sigterm_raises():
            try:
                return run(args)
            except (KeyboardInterrupt, Terminated) as stop:  # while loading, or SIGTERM: one line, no traceback
                return stop_status(logger, stop)
    finally:
        package.removeHandler(handler)
        package.setLevel(saved[0])
        package.propagate = saved[1]


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (importing it gives input() history and editing)
    except ImportError:
        pass


if __name__ == "__main__":
    run_as_main(main)
