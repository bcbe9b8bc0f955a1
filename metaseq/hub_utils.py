"""Serve a checkpoint without FSDP: load it into a plain model and generate text.

Two inputs are accepted:

- a consolidated, unflattened file (what
  `python -m metaseq.scripts.reshard_fsdp ... --num-output-shards 1 --unflatten-weights True`
  writes, conventionally `reshard-model_part-0.pt`), loaded with `strict=True`;
- raw FSDP shards, named by a glob (`DIR/checkpoint_last-model_part-0-shard*.pt`) or
  by their stem (`DIR/checkpoint_last.pt`), consolidated by the reshard planner into
  a temporary file: no process group is needed;
- the P parts of a model-parallel checkpoint (`DIR/reshard-model_part-{j}.pt`, or a glob
  matching several parts' files), merged into one plain model by the same planner.

The model is rebuilt from the checkpoint's `cfg["model"]`, so no size flags are needed.

    gen = GeneratorInterface.from_checkpoint("demo_out/reshard_1/reshard-model_part-0.pt")
    gen.generate(["what is the meaning of life?"])  # [" To be happy."]
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Collection, Mapping

import torch
import torch.nn.functional as F

from metaseq.errors import UserError, check_field_types
from metaseq.file_io import (find_shards, folder_hint, glob_files, is_glob, load_checkpoint, model_part_number,
                             shard_glob)
from metaseq.hf.errors import ConversionError
from metaseq.hf.names import check_state_matches_model, check_whole_model, upstream_state_for_model
from metaseq.hf.tokenization import ByteTokenizer, TextTokenizer
from metaseq.hf.variants import is_upstream_cfg, merge_parts_command, model_config_from_cfg, model_parallel_size
from metaseq.models.transformer_lm import TransformerLanguageModel, build_model
from metaseq.reshard import ReshardError, ReshardOptions
from metaseq.reshard.plan import plan_model_parallel, plan_structures, read_inputs
from metaseq.reshard.schema import clean_key, is_omegaconf
from metaseq.reshard.write import list_jobs, write_outputs
from metaseq.tokenizer import BOS, EOS, PAD, UNK, VOCAB_SIZE, encode
from metaseq.torchzip import NeedsTorch, Opaque, TensorRef, read_checkpoint, to_torch

__all__ = [
    "NEWLINE",
    "GenerationConfig",
    "GeneratorInterface",
    "InferenceLoadError",
    "build_inference_model",
    "check_state_keys",
    "check_tied_weights",
    "check_tokenizer_fits",
    "generate_ids",
    "load_inference_checkpoint",
    "next_tokens",
    "plain_config",
    "read_servable",
    "resolve_checkpoint_files",
    "unflatten_command",
]

logger = logging.getLogger(__name__)

NEWLINE = encode("\n", bos=False)[0]
_FLAT_KEY = re.compile(r"(^|\.)flat_param_\d+$")
_SHOWN_KEYS = 6


class InferenceLoadError(UserError, RuntimeError):
    """A checkpoint cannot be served as given; the message names the file and the fix."""


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: bool = False  # False: greedy (argmax), deterministic
    temperature: float = 1.0  # sampling only
    top_p: float = 1.0  # sampling only: keep the smallest set of tokens with this much mass
    seed: int = 1  # sampling only
    stop_at_newline: bool = True  # EOS always stops

    def validate(self) -> None:
        """Raise ValueError naming the flag to change."""
        check_field_types(self, ValueError)
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens={self.max_new_tokens} must be at least 1")
        if not 0 < self.temperature < math.inf:
            fix = "for the argmax, leave out --sampling" if self.sampling else "it applies only with --sampling"
            raise ValueError(f"--temperature={self.temperature} must be a finite number > 0 ({fix})")
        if not 1e-6 <= self.temperature <= 1e6:  # float32 logits / temperature stay finite
            raise ValueError(f"--temperature={self.temperature} must be from 1e-06 to 1e+06 (below: leave out "
                             "--sampling for the argmax; above: every token is about equally likely)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"--seed={self.seed} does not fit in 64 bits; give one from -2**63 to 2**64 - 1")


def resolve_checkpoint_files(path: str) -> tuple[list[str], bool]:
    """(files, sharded): one consolidated file, or the natural-sorted shards `path` names.

    An existing file is taken as consolidated; a glob pattern or a stem such as
    `DIR/checkpoint_last.pt` (for `DIR/checkpoint_last-model_part-0-shard*.pt`) names shards.
    """
    path = os.path.expanduser(path)  # '~' as the shell would, also when quoted
    if os.path.isfile(path):
        return [path], False
    if hint := folder_hint(path):
        raise InferenceLoadError(f"--path {path}{hint}")
    pattern = path if is_glob(path) else shard_glob(path)
    fix = ("pass a consolidated file (reshard-model_part-0.pt), all shards of one checkpoint as a glob, or a stem "
           "such as DIR/checkpoint_last.pt")
    try:
        files = find_shards(pattern, flag="--path")
    except UserError as e:
        if is_glob(path):
            raise InferenceLoadError(f"{e}; {fix}") from None
        if not glob_files(pattern):  # the glob is ours, not the user's: say what they gave is not there
            raise InferenceLoadError(f"--path {path}: no such file, nor shards of a save by that name ({pattern}); "
                                     f"{fix}") from None
        raise InferenceLoadError(f"--path {path}: {e}; {fix}") from None
    return files, True


def load_inference_checkpoint(path: str, *, trust: bool = False) -> dict[str, Any]:
    """The consolidated checkpoint dict behind `path` (see `resolve_checkpoint_files`).

    Shards are consolidated by the reshard tool into a temporary file (bounded memory),
    which is then loaded like a consolidated file.
    """
    path = os.path.expanduser(path)
    parts = _model_parts_pattern(path)
    files, sharded = ([], True) if parts else resolve_checkpoint_files(path)
    if not sharded:
        return read_servable(files[0], trust=trust)
    with tempfile.TemporaryDirectory(prefix="metaseq-consolidate-") as tmp:
        out = os.path.join(tmp, "reshard-model_part-0.pt")
        options = ReshardOptions(input_glob_pattern=parts or "", output_shard_name=out, unflatten_weights=True,
                                 skip_optimizer_state=True, trust_checkpoint=trust, num_workers=1, quiet=True,
                                 num_output_parts=1 if parts else None)
        try:
            plan = (plan_model_parallel(options, flag="the glob of its parts") if parts else
                    plan_structures(read_inputs(files, trust=trust), options, [out]))
            write_outputs(list_jobs([plan]))
        except (ReshardError, UserError) as e:  # e.g. an incomplete or inconsistent shard set
            raise InferenceLoadError(f"--path {path}: cannot consolidate its files: {e}") from None
        logger.info("consolidated %d file(s) into one", len(plan.inputs))
        return read_servable(out, trust=trust)


def _model_parts_pattern(path: str) -> str | None:
    """A glob of several model parts' files (`{j}` for the part, or a glob matching several), else None."""
    pattern = path.replace("{j}", "*")
    if not is_glob(path) and not os.path.isfile(path) and "{j}" not in path:
        pattern = shard_glob(path, "*")  # a stem such as DIR/checkpoint_last.pt: every part's shards
    parts = {model_part_number(p) for p in glob_files(pattern)} - {None}
    return pattern if "{j}" in path or len(parts) > 1 else None


def read_servable(path: str, *, trust: bool = False, mmap: bool = False) -> dict[str, Any]:
    """A file's `model` (torch tensors; `mmap`: mapped from the file) and `cfg`, read without running anything it
    holds.

    The rest of a checkpoint (optimizer state, extra_state with objects of classes that
    may not exist here, such as upstream's data loader state) is not needed to serve it.
    Only files in torch's legacy format are loaded with torch (`trust` as for training).
    """
    try:
        structure, _ = read_checkpoint(path)
    except NeedsTorch:
        return load_checkpoint(path, trust=trust, mmap=mmap)
    if not isinstance(structure, dict):
        kind = "Tensor" if isinstance(structure, TensorRef) else type(structure).__name__
        raise InferenceLoadError(f"{path}: expected a checkpoint dict, found {kind}")
    return {key: to_torch(plain_config(structure[key]), mmap=mmap) for key in ("model", "cfg") if key in structure}


def plain_config(obj: Any) -> Any:
    """A carried config as plain objects: `argparse.Namespace` records as Namespaces, omegaconf containers
    (upstream's `restored.pt`) as dicts and lists of their values; anything else as it is."""
    if isinstance(obj, Opaque) and obj.qualname == "Namespace" and isinstance(obj.state, dict):
        return argparse.Namespace(**plain_config(obj.state))
    if is_omegaconf(obj):
        content = obj.state.get("_content", obj.state.get("_val"))
        return plain_config(content)
    if isinstance(obj, dict):
        return {key: plain_config(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_config(value) for value in obj)
    return obj


def build_inference_model(ckpt: Mapping[str, Any], *, source: str) -> TransformerLanguageModel:
    """A plain (non-FSDP) model in eval mode, built from `ckpt["cfg"]["model"]`, weights loaded strictly."""
    try:
        cfg_model = ckpt["cfg"]["model"]
        state = ckpt["model"]
    except (KeyError, TypeError):
        raise InferenceLoadError(
            f"{source}: no cfg['model'] or no 'model' weights; this is not a metaseq checkpoint"
        ) from None
    state = {clean_key(str(k)): v for k, v in state.items()}  # FSDP's hooks usually did this already
    try:  # this project's dict, or upstream metaseq's Namespace (real OPT; OPT-350m refused)
        if is_upstream_cfg(cfg_model):
            state = upstream_state_for_model(state)
        model_cfg = model_config_from_cfg(cfg_model, state, source=source)
        if model_parallel_size(ckpt["cfg"]) != 1:
            check_whole_model(model_cfg, state, ckpt["cfg"], source=source, fix=_every_part(source))
    except ConversionError as e:
        raise InferenceLoadError(str(e)) from None
    model = build_model(model_cfg)
    check_state_keys(set(model.state_dict()), set(state), source=source)
    try:  # the names match: now the shapes
        check_state_matches_model(model_cfg, state, source=source)
    except ConversionError as e:
        raise InferenceLoadError(f"{e}; its cfg['model'] does not describe these weights (edited?)") from None
    check_tied_weights(model, state, source=source)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _every_part(source: str) -> str:
    """How to serve the model one part `source` of is: every part through '{j}', or merged first."""
    every = re.sub(r"-shard\d+\.pt$", "-shard*.pt", re.sub(r"model_part-\d+", "model_part-{j}", source))
    example = f", --path '{every}'" if every != source else ""
    return (f"pass every part with '{{j}}' for the part number{example}, or merge them first with "
            f"{merge_parts_command(source)}")


def check_tokenizer_fits(model: TransformerLanguageModel, tokenizer: TextTokenizer, *, source: str) -> None:
    """A tokenizer with more ids than the model's vocabulary would index past its embedding."""
    size = getattr(tokenizer, "vocab_size", None)
    if size is not None and size > model.cfg.vocab_size:
        raise InferenceLoadError(
            f"{source}: the tokenizer {getattr(tokenizer, 'source', '')} has {size} ids but the model's vocabulary "
            f"only {model.cfg.vocab_size}; pass the tokenizer this model was trained with"
        )


def check_tied_weights(model: torch.nn.Module, state: Mapping[str, Any], *, source: str) -> None:
    """Names of one tied parameter must hold equal tensors, or loading would silently keep only one."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    for first, *others in names_by_param.values():
        for other in others:
            if not torch.equal(state[first], state[other]):
                raise InferenceLoadError(
                    f"{source}: '{first}' and '{other}' are tied in the model but differ in the file; "
                    "it was not consolidated from one model"
                )


def check_state_keys(expected: set[str], found: set[str], *, source: str) -> None:
    """Raise InferenceLoadError listing missing/unexpected keys; say so when the file is still flat."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if not missing and not unexpected:
        return
    flat = [k for k in unexpected if _FLAT_KEY.search(k)]
    if flat:
        raise InferenceLoadError(
            f"{source}: the weights are still flat (FSDP flat parameters {_show(flat)} instead of "
            f"{len(missing)} parameter names such as {_show(missing)}); unflatten them with: "
            f"{unflatten_command(source)}"
        )
    raise InferenceLoadError(
        f"{source}: the weights do not match the model built from its cfg: "
        f"missing keys {_show(missing)}; unexpected keys {_show(unexpected)}"
    )


def unflatten_command(source: str) -> str:
    """The reshard command that turns `source` (a flat file or one shard of a set) into a servable file."""
    inputs = re.sub(r"-shard\d+\.pt$", "-shard*.pt", source)
    output = os.path.join(os.path.dirname(source) or ".", "reshard-model_part-0.pt")
    if os.path.abspath(output) == os.path.abspath(source):  # a flat file of that name: not over itself
        output = os.path.join(os.path.dirname(source) or ".", "unflattened", "reshard-model_part-0.pt")
    return (
        f"python -m metaseq.scripts.reshard_fsdp --input-glob-pattern '{inputs}' --output-shard-name '{output}' "
        "--num-output-shards 1 --unflatten-weights True --skip-optimizer-state True"
    )


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    more = f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return f"[{shown}{more}]"


def next_tokens(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator) -> torch.Tensor:
    """logits (B, V) -> token ids (B,): argmax, or a temperature/top-p sample."""
    logits = logits.clone()
    logits[:, [BOS, PAD, UNK]] = float("-inf")  # never valid outputs
    if not cfg.sampling:
        return logits.argmax(dim=-1)
    probs = F.softmax(logits / cfg.temperature, dim=-1)  # (B, V)
    if cfg.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the tokens before it already hold top_p; the first always stays.
        sorted_probs[sorted_probs.cumsum(dim=-1) - sorted_probs >= cfg.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _pad_prompts(prompts: list[list[int]], limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with PAD to (B, limit) int64; also returns the lengths (B,)."""
    for p in prompts:
        if not 0 < len(p) < limit:
            raise ValueError(
                f"a prompt of {len(p)} tokens does not fit: prompts need 1 to {limit - 1} tokens "
                f"(the model holds max_target_positions={limit}); shorten it"
            )
    tokens = torch.full((len(prompts), limit), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long)


@torch.no_grad()
def generate_ids(
    model: TransformerLanguageModel,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    *,
    newline_ids: Collection[int] = (NEWLINE,),
) -> list[list[int]]:
    """New token ids per prompt, without the stop token.

    Prompts are right-padded into one (B, T) batch; with causal attention the padding
    after a row's last token cannot change that row's logits, so a row decodes exactly
    as it would alone. A row stops at EOS, at a newline (`stop_at_newline`), after
    `max_new_tokens` or when it fills the model's `max_target_positions`. `newline_ids`: the
    tokenizer's ids holding a newline (a GPT-2 BPE has several).
    """
    limit = model.cfg.max_target_positions
    tokens, lengths = _pad_prompts(prompts, limit)  # (B, limit), (B,)
    stops = {EOS, *newline_ids} if cfg.stop_at_newline else {EOS}
    generator = torch.Generator().manual_seed(cfg.seed)
    out: list[list[int]] = [[] for _ in prompts]
    active = torch.ones(len(prompts), dtype=torch.bool)
    for _ in range(cfg.max_new_tokens):
        active &= lengths < limit
        rows = active.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        logits = model(tokens[rows, : int(lengths[rows].max())])  # (b, T, V)
        picked = next_tokens(logits[torch.arange(rows.numel()), lengths[rows] - 1], cfg, generator)
        for row, tok in zip(rows.tolist(), picked.tolist()):
            if tok in stops:
                active[row] = False
                continue
            out[row].append(tok)
            tokens[row, lengths[row]] = tok
            lengths[row] += 1
    return out


class GeneratorInterface:
    """Text in, text out, around a plain `TransformerLanguageModel`.

    `tokenizer` defaults to this project's byte tokenizer; real OPT models need their GPT-2
    BPE (`metaseq.hf.BPETokenizer.from_vocab_merges` or `.from_hf_folder`).
    """

    def __init__(self, model: TransformerLanguageModel, tokenizer: TextTokenizer | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer or ByteTokenizer()

    @classmethod
    def from_checkpoint(
        cls, path: str, *, trust: bool = False, tokenizer: TextTokenizer | None = None
    ) -> "GeneratorInterface":
        """Load a consolidated file or raw shards (see the module docstring)."""
        model = build_inference_model(load_inference_checkpoint(path, trust=trust), source=path)
        if tokenizer is None and model.cfg.vocab_size != VOCAB_SIZE:
            raise InferenceLoadError(
                f"{path}: the model has {model.cfg.vocab_size} tokens, not the byte tokenizer's {VOCAB_SIZE}; "
                "pass its tokenizer: --vocab-filename gpt2-vocab.json --merges-filename gpt2-merges.txt "
                "(real OPT) or --hf-tokenizer DIR"
            )
        if tokenizer is not None:
            check_tokenizer_fits(model, tokenizer, source=path)
        n = sum(p.numel() for p in model.parameters())
        logger.info("loaded %s: %d parameters, %d layers", path, n, model.cfg.decoder_layers)
        return cls(model, tokenizer)

    def generate(self, prompts: list[str], cfg: GenerationConfig | None = None) -> list[str]:
        """One completion per prompt (the text after the prompt, stop token excluded)."""
        cfg = cfg or GenerationConfig()
        cfg.validate()
        if isinstance(prompts, str):
            raise ValueError("generate takes a list of prompt strings, e.g. generate([prompt]), not one string")
        prompts = list(prompts)  # any iterable, read once
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("generate takes a list of prompt strings, e.g. generate([prompt])")
        tok = self.tokenizer
        ids = generate_ids(self.model, [tok.encode(p) for p in prompts], cfg, newline_ids=tok.newline_ids)
        return [tok.decode(x) for x in ids]
