"""A Hugging Face OPT folder -> this project's checkpoints: raw FSDP shards or one consolidated file.

    convert_from_hf("hf_model", "ckpts/checkpoint_last-model_part-0-shard{i}.pt", num_output_shards=4)

The weights are renamed (no copy, no cast) into a consolidated, unflattened checkpoint
whose `shard_metadata` is what fairscale FSDP reports for our model
(`metaseq.hf.fsdp_layout`); `reshard_fsdp_checkpoints` then cuts it into raw shards for
any world size. No optimizer state is carried: training resumes with a fresh Adam.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from metaseq.file_io import atomic_torch_save
from metaseq.hf.config import DTYPE_NAMES, model_config_from_hf
from metaseq.hf.errors import ConversionError
from metaseq.hf.fsdp_layout import fsdp_shard_metadata
from metaseq.hf.names import check_state_matches_model, from_hf_state_dict
from metaseq.hf.tokenization import require
from metaseq.models.transformer_lm import ModelConfig
from metaseq.reshard import ReshardError, ReshardOptions, reshard_fsdp_checkpoints
from metaseq.reshard.plan import check_output_name, output_paths

__all__ = ["check_one_dtype", "checkpoint_from_hf", "convert_from_hf", "read_hf_folder"]

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
PYTORCH_BIN_INDEX = "pytorch_model.bin.index.json"


def convert_from_hf(
    input_dir: str | os.PathLike,
    output_shard_name: str,
    *,
    num_output_shards: int = 1,
    unflatten_weights: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """Write `num_output_shards` raw shards (`{i}` in the name), or one consolidated file; returns the paths.

    Everything (folder, config, weights, output names) is checked before anything is written.
    """
    input_dir, output_shard_name = os.path.expanduser(input_dir), os.path.expanduser(output_shard_name)  # quoted '~'
    outputs = _output_paths(output_shard_name, num_output_shards, unflatten_weights, overwrite, input_dir)
    hf_cfg, state = read_hf_folder(input_dir)
    ckpt = checkpoint_from_hf(hf_cfg, state, source=str(input_dir))
    with tempfile.TemporaryDirectory(prefix="metaseq-from-hf-") as tmp:
        consolidated = os.path.join(tmp, "reshard-model_part-0.pt")
        atomic_torch_save(ckpt, consolidated)
        written = reshard_fsdp_checkpoints(consolidated, output_shard_name, num_output_shards=num_output_shards,
                                           unflatten_weights=unflatten_weights, overwrite=overwrite)
    assert written == outputs, (written, outputs)
    if not unflatten_weights:
        logger.warning("no optimizer state in %s: training restored from it starts Adam from scratch", input_dir)
    return written


def _output_paths(name: str, count: int, unflatten: bool, overwrite: bool, input_dir: str | os.PathLike) -> list[str]:
    """The reshard tool's checks of the output options and names, before the (slow) conversion; the files of
    the Hugging Face folder are its inputs (never written over, --overwrite or not)."""
    if "{j}" in name:
        raise ConversionError(f"--output-shard-name {name}: '{{j}}' (the model part) does not apply: the output is "
                              "one model part, part 0; write 0 instead, e.g. "
                              "'out/checkpoint_last-model_part-0-shard{i}.pt'")
    try:
        ReshardOptions(output_shard_name=name, num_output_shards=count, unflatten_weights=unflatten)
        check_output_name(name, count)
        inputs = [str(p) for p in Path(input_dir).iterdir() if p.is_file()] if os.path.isdir(input_dir) else []
        return output_paths(name, count, inputs, overwrite=overwrite)
    except ReshardError as e:
        raise ConversionError(str(e)) from None


def read_hf_folder(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, every weight by its HF name) from `model.safetensors` or `pytorch_model.bin`, or the
    files a sharded checkpoint's index names (`model.safetensors.index.json`, `pytorch_model.bin.index.json`)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConversionError(f"--input {folder} is a file; pass a Hugging Face model folder (config.json and its "
                              "weights)")
    if not folder.is_dir():
        raise ConversionError(f"--input {folder}: no such folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"--input {folder}: no config.json there; pass a Hugging Face model folder")
    try:
        hf_cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConversionError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf_cfg, dict):
        raise ConversionError(f"{config_path}: holds a JSON {type(hf_cfg).__name__}, not an object of model fields; "
                              "pass a Hugging Face model folder (its config.json as save_pretrained writes it)")
    return hf_cfg, _read_weights(folder)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / SAFETENSORS).is_file():
        return _read_safetensors([folder / SAFETENSORS])
    if (folder / SAFETENSORS_INDEX).is_file():
        return _read_safetensors(_index_files(folder / SAFETENSORS_INDEX))
    if (folder / PYTORCH_BIN).is_file():
        return _read_pytorch_bin(folder / PYTORCH_BIN)
    if (folder / PYTORCH_BIN_INDEX).is_file():
        return {k: v for path in _index_files(folder / PYTORCH_BIN_INDEX) for k, v in _read_pytorch_bin(path).items()}
    raise ConversionError(f"--input {folder}: no weights there ({SAFETENSORS}, {PYTORCH_BIN} or their sharded "
                          f"indexes {SAFETENSORS_INDEX}, {PYTORCH_BIN_INDEX})")


def _index_files(index_path: Path) -> list[Path]:
    """The weight files a sharded checkpoint's index names, each once, in the index's order."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        files = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConversionError(f"{index_path}: no valid 'weight_map' ({type(e).__name__}: {e})") from None
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConversionError(f"{index_path} names {missing[0]}, which does not exist; is the download complete?")
    return files


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    safetensors = require("safetensors")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except Exception as e:  # truncated or not a safetensors file
            raise ConversionError(f"{path}: cannot read it as safetensors ({type(e).__name__}: {e})") from None
    return state


def _read_pytorch_bin(path: Path) -> dict[str, torch.Tensor]:
    try:  # mapped; torch's legacy (non-zip) format cannot be, and is read into memory
        legacy = not zipfile.is_zipfile(path)
        state = torch.load(path, map_location="cpu", mmap=not legacy, weights_only=True)
    except Exception as e:
        text = " ".join(str(e).split())
        text = text if len(text) <= 160 else text[:157] + "..."
        raise ConversionError(f"{path}: cannot read it ({type(e).__name__}: {text})") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return {k: _own_storage(v) for k, v in state.items()}


def _own_storage(value: Any) -> Any:
    """A tensor that is all of its storage, in order: a transposed or sliced weight (torch.save keeps such views,
    which the reshard tool refuses) is copied; others are kept as they are."""
    if not isinstance(value, torch.Tensor) or (
            value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()):
        return value
    return value.clone(memory_format=torch.contiguous_format)


def checkpoint_from_hf(hf_cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor], *, source: str) -> dict[str, Any]:
    """A consolidated, unflattened checkpoint dict (the layout `reshard_fsdp --unflatten-weights` writes)."""
    config = model_config_from_hf(hf_cfg, source=f"{source}/config.json")
    check_one_dtype(state, source=source)
    ours = from_hf_state_dict(state, source=source)
    check_state_matches_model(config, ours, source=source)
    return {
        "model": ours,
        "shard_metadata": fsdp_shard_metadata(config),
        "cfg": _cfg(config, source),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "extra_state": {"metrics": {}, "previous_training_time": 0.0, "train_iterator": None},
    }


def check_one_dtype(state: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Refuse weights of several dtypes (e.g. fp16 with fp32 LayerNorms): FSDP flattens each instance's
    parameters into one tensor of one dtype, so they could not keep their dtypes."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, tensor in state.items():
        by_dtype.setdefault(tensor.dtype, []).append(key)
    if len(by_dtype) > 1:
        counts = ", ".join(f"{len(keys)} {str(d).replace('torch.', '')} (e.g. {keys[0]})" for d, keys in
                           sorted(by_dtype.items(), key=lambda item: -len(item[1])))
        raise ConversionError(f"{source}: the weights mix dtypes: {counts}; weights keep their dtype, so save the "
                              "model in one first, e.g. model.to(torch.float16).save_pretrained(DIR)")
    dtype = next(iter(by_dtype), None)
    if dtype is not None and dtype not in DTYPE_NAMES:  # quantized (int8) weights, float64, or not weights
        kind = "" if dtype.is_floating_point else ", not floating point (quantized?)"
        raise ConversionError(f"{source}: the weights are {str(dtype).replace('torch.', '')}{kind}, which the "
                              "export back to HF does not take; save the model in float32, float16 or bfloat16 first")


def _cfg(config: ModelConfig, source: str) -> dict[str, Any]:
    """What metaseq.cli.train and interactive_cli read: the model config; the rest describes the origin."""
    return {
        "model": config.to_dict(),
        "distributed_training": {"distributed_world_size": 1, "distributed_rank": 0,
                                 "ddp_backend": "fully_sharded", "use_sharded_state": True},
        "task": {"converted_from_hf": str(source)},
    }
