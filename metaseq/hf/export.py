"""A metaseq checkpoint -> a Hugging Face OPT folder (`OPTForCausalLM.from_pretrained(DIR)`).

    convert_to_hf("out/reshard-model_part-0.pt", "hf_model")
    convert_to_hf("ckpts/checkpoint_last-model_part-0-shard*.pt", "hf_model")   # raw shards

Raw shards (or a flat file) are first consolidated by `reshard_fsdp_checkpoints` into a
temp file, which is then read with mmap, so memory stays near one copy of the weights.
Weights keep their bytes and dtype; the folder appears complete or not at all.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from metaseq.errors import UserError
from metaseq.file_io import find_shards, folder_hint, glob_files, is_glob, model_part_number, shard_glob
from metaseq.hf.config import DTYPE_NAMES, hf_config, hf_generation_config
from metaseq.hf.errors import ConversionError
from metaseq.hf.names import check_whole_model, split_fused_qkv, to_hf_state_dict, upstream_state_for_model
from metaseq.hf.outdir import TOKENIZER_FILE, atomic_directory, check_output_directory
from metaseq.hf.tokenization import ByteTokenizer, byte_tokenizer_files, require
from metaseq.hf.variants import (FUSED_QKV_ORDER_OURS, is_opt_exact, is_upstream_cfg, merge_parts_command,
                                 model_config_from_cfg)
from metaseq.models.transformer_lm import ModelConfig
from metaseq.reshard import reshard_fsdp_checkpoints
from metaseq.tokenizer import BOS, EOS, VOCAB_SIZE

__all__ = ["convert_to_hf", "hf_tensors_from_checkpoint", "input_files", "write_hf_folder"]

logger = logging.getLogger(__name__)

_WRAPPERS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_fpw_module)\.")
SAFETENSORS_NAME = "model.safetensors"


def convert_to_hf(input_path: str, output_dir: str | os.PathLike, *, overwrite: bool = False,
                  trust_checkpoint: bool = False) -> Path:
    """Write `output_dir` from a consolidated file or a glob of one model part's raw shards.

    Raises ConversionError (or CheckpointLoadError/ReshardError) before writing anything
    when the input cannot be converted: old-variant or OPT-350m models, unknown weights,
    model-parallel parts, an output folder that holds an input (replacing it would delete it).
    """
    input_path, output_dir = os.path.expanduser(input_path), os.path.expanduser(output_dir)  # a quoted '~' too
    if not is_glob(input_path) and not os.path.isfile(input_path) and glob_files(shard_glob(input_path)):
        input_path = shard_glob(input_path)  # the name of a save (DIR/checkpoint_last.pt), as training takes it
    try:
        inputs = input_files(input_path)
    except ConversionError:
        check_output_directory(output_dir, overwrite=overwrite)  # a wrong --output is named first
        raise
    check_output_directory(output_dir, overwrite=overwrite, inputs=inputs)  # "holds the input" before "not empty"
    require("safetensors")
    with tempfile.TemporaryDirectory(prefix="metaseq-to-hf-") as tmp:
        ckpt = _load_unflattened(input_path, tmp, trust_checkpoint)
        config, tensors = hf_tensors_from_checkpoint(ckpt, source=input_path)
        with_tokenizer = not is_upstream_cfg(ckpt["cfg"]["model"]) and config.vocab_size == VOCAB_SIZE
        if not with_tokenizer:
            logger.warning("%s: a vocabulary of %d tokens is not this project's byte tokenizer; no tokenizer "
                           "files written and only EOS stops generation: copy the model's own tokenizer (e.g. an "
                           "HF OPT tokenizer) into %s (an --overwrite export keeps it)", input_path,
                           config.vocab_size, output_dir)
        out = write_hf_folder(output_dir, config, tensors, overwrite=overwrite, with_tokenizer=with_tokenizer)
    logger.info("wrote %s: %d tensors, %s", out, len(tensors), DTYPE_NAMES[_dtype(tensors)])
    return out


def input_files(input_path: str) -> list[str]:
    """The files `--input` names (a file, or a glob of one model part's shards), each checked to be readable."""
    if not is_glob(input_path):
        hint = folder_hint(input_path, globs=True)
        if hint:
            raise ConversionError(f"--input {input_path}{hint}")
        if not os.path.isfile(input_path):
            raise ConversionError(f"--input {input_path}: no such file (quote a glob of raw shards: 'DIR/*-shard*.pt')")
        files = [input_path]
    else:
        files = glob_files(input_path)
        if not files:
            raise ConversionError(f"--input {input_path!r} matches no files")
        parts = sorted({model_part_number(p) for p in files} - {None})
        if len(parts) > 1:
            raise ConversionError(f"--input {input_path!r} matches model parts {parts} of a model-parallel "
                                  f"checkpoint; export needs the whole model in one part: merge them first with "
                                  f"{merge_parts_command(files[0])}, then pass its output as --input")
        try:
            files = find_shards(input_path, flag="--input")
        except UserError as e:
            raise ConversionError(str(e)) from None
    return files


def _load_unflattened(input_path: str, tmp: str, trust: bool) -> dict[str, Any]:
    """The checkpoint's `model` (unflattened) and `cfg`; nothing else it holds is unpickled (`read_servable`)."""
    from metaseq.hub_utils import read_servable  # here: hub_utils imports metaseq.hf

    if not is_glob(input_path):
        ckpt = read_servable(input_path, trust=trust, mmap=True)
        if not any("flat_param_" in str(k) for k in ckpt.get("model", {})):
            return ckpt
    consolidated = os.path.join(tmp, "consolidated.pt")
    reshard_fsdp_checkpoints(input_path, consolidated, unflatten_weights=True, skip_optimizer_state=True,
                             trust_checkpoint=trust)
    logger.info("consolidated %s into a temp file", input_path)
    return read_servable(consolidated, mmap=True)


def hf_tensors_from_checkpoint(ckpt: Mapping[str, Any], *, source: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(our model config, HF-named tensors) of an unflattened checkpoint; checked against the model's shapes."""
    try:
        cfg_model, state = ckpt["cfg"]["model"], ckpt["model"]
    except (KeyError, TypeError):
        raise ConversionError(f"{source}: no cfg['model'] or no 'model' weights; this is not a metaseq checkpoint") from None
    state = {_WRAPPERS.sub(r"\1", str(k)): v for k, v in state.items()}
    if is_upstream_cfg(cfg_model):  # as inference completes it: K, V, Q split, tied head and version added if absent
        state = upstream_state_for_model(state)
    else:
        state = split_fused_qkv(state, FUSED_QKV_ORDER_OURS)
    config = model_config_from_cfg(cfg_model, state, source=source)
    if getattr(config, "fused_qkv", False):  # HF's OPT has q_proj, k_proj, v_proj
        config = dataclasses.replace(config, fused_qkv=False)
    check_whole_model(config, state, ckpt["cfg"], source=source, fix="export needs the whole model in one part: "
                      f"merge the parts first with {merge_parts_command(source)}, then pass its output as --input")
    if not is_opt_exact(config):
        unlike = [text for text, differs in (("its embeddings are scaled", not config.no_scale_embedding),
                                             (f"its positions are offset by {config.position_offset}, not 2",
                                              config.position_offset != 2)) if differs]
        raise ConversionError(
            f"{source}: written before the OPT-exact change (cfg['model'] no_scale_embedding="
            f"{config.no_scale_embedding}, position_offset={config.position_offset}): {' and '.join(unlike)}, "
            "which OPTForCausalLM cannot compute exactly; serve it with metaseq.cli.interactive_cli, or retrain "
            "it with the current metaseq.cli.train to export it"
        )
    return config, to_hf_state_dict(state)


def _dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise ConversionError(f"the weights mix or use unsupported dtypes {sorted(map(str, dtypes))}; "
                              "convert them to one of float32, float16, bfloat16 first (reshard_fsdp --output-dtype)")
    return dtypes.pop()


def write_hf_folder(output_dir: str | os.PathLike, config: ModelConfig, tensors: Mapping[str, torch.Tensor], *,
                    overwrite: bool = False, with_tokenizer: bool = True) -> Path:
    """config.json, generation_config.json, model.safetensors (+ the byte tokenizer's files), atomically.

    Generation stops at a newline only `with_tokenizer` (the byte tokenizer, whose newline id is known); without
    it prompts start with `</s>`, as in OPT's GPT-2 BPE."""
    newline_ids, bos = (ByteTokenizer.newline_ids, BOS) if with_tokenizer else ((), EOS)  # OPT's BPE starts with </s>
    files = {
        "config.json": _json(hf_config(config, _dtype(tensors), bos=bos)),
        "generation_config.json": _json(hf_generation_config(config, newline_ids=newline_ids, bos=bos)),
    }
    if with_tokenizer:
        files.update(byte_tokenizer_files(config.max_target_positions))
    kept = []
    with atomic_directory(output_dir, overwrite=overwrite) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_safetensors(tmp / SAFETENSORS_NAME, tensors, {"format": "pt"})
        for old in sorted(Path(output_dir).iterdir()) if not with_tokenizer and Path(output_dir).is_dir() else ():
            if old.is_file() and TOKENIZER_FILE.fullmatch(old.name):  # the model's own, copied in after an export
                shutil.copy2(old, tmp / old.name)
                kept.append(old.name)
    if kept:
        logger.info("kept %s: the tokenizer in the folder this export replaces", ", ".join(kept))
    return Path(output_dir)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format written tensor by tensor (`safetensors.safe_open` reads it): an 8-byte
    header length, the JSON header padded to 8 bytes, then each tensor's bytes in order. Tensors
    mapped from disk are copied a chunk at a time, so memory stays small whatever the model."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for tensor in tensors.values():
            flat = tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else None
            for start in range(0, 0 if flat is None else flat.numel(), 64 << 20):
                f.write(flat[start : start + (64 << 20)].numpy().tobytes())


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
