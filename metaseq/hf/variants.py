"""Which model a checkpoint's `cfg["model"]` describes, and whether it can be served or converted.

Two kinds of `cfg["model"]` exist:

- this project's plain dict (`ModelConfig.to_dict()`); one without `no_scale_embedding`
  was written before the model became OPT-exact and holds the earlier variant
  (token embeddings scaled by sqrt(dim), position t at row t);
- upstream metaseq's `argparse.Namespace` (real OPT checkpoints; an omegaconf
  `DictConfig` in some consolidated files): sizes under the same names, no
  `vocab_size` (the vocabulary is the embedding's row count) and OPT's architecture
  unless a field says otherwise (`no_scale_embedding=False` scales the embeddings).

OPT-350m's variant (`decoder_input_dim`/`decoder_output_dim` different from
`decoder_embed_dim`, i.e. `project_in_dim`/`project_out_dim`, with post-LayerNorm
blocks) and other architectures are refused with a `ConversionError` naming the field.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Any, Mapping

from metaseq.hf.errors import ConversionError
from metaseq.models.transformer_lm import ModelConfig
from metaseq.reshard.schema import cfg_value

__all__ = [
    "FUSED_QKV_ORDER_METASEQ",
    "FUSED_QKV_ORDER_OURS",
    "cfg_as_dict",
    "check_supported_state",
    "is_opt_exact",
    "is_upstream_cfg",
    "merge_parts_command",
    "model_config_from_cfg",
    "model_parallel_size",
]

# Upstream metaseq's sequence-parallel layer stores K, V, Q on dim 0 despite the name
# `qkv_proj` (transformers' own OPT converter splits it so); this project's fused layout is Q, K, V.
FUSED_QKV_ORDER_METASEQ = ("k", "v", "q")
FUSED_QKV_ORDER_OURS = ("q", "k", "v")

EMBED_TOKENS = "decoder.embed_tokens.weight"
_PROJECTION_KEYS = ("decoder.project_in_dim.weight", "decoder.project_out_dim.weight")


def cfg_as_dict(cfg_model: Any) -> dict[str, Any]:
    """A plain dict of a `cfg["model"]`: a dict, an `argparse.Namespace` or any mapping (DictConfig)."""
    if isinstance(cfg_model, argparse.Namespace):
        return dict(vars(cfg_model))
    if isinstance(cfg_model, Mapping):
        return {str(k): v for k, v in cfg_model.items()}
    raise ConversionError(f"cfg['model'] is a {type(cfg_model).__name__}, not a dict or argparse.Namespace")


def is_upstream_cfg(cfg_model: Any) -> bool:
    """True for upstream metaseq's cfg (a Namespace or DictConfig), False for this project's plain dict."""
    return not isinstance(cfg_model, dict)


def model_config_from_cfg(cfg_model: Any, state: Mapping[str, Any] | None = None, *, source: str) -> ModelConfig:
    """The `ModelConfig` to build for a checkpoint; refuses variants the model cannot compute.

    `state` (the unflattened weights, tensors or meta tensors) supplies the vocabulary size
    when the cfg has none (upstream metaseq) and is checked for OPT-350m's projections.
    """
    fields = cfg_as_dict(cfg_model)
    _check_upstream_fields(fields, source)
    if state is not None:
        check_supported_state(state, source=source)
    if is_upstream_cfg(cfg_model):
        fields.setdefault("no_scale_embedding", True)  # OPT's runs set it; ModelConfig then uses offset 2
        if "vocab_size" not in fields:
            fields["vocab_size"] = _vocab_from_state(state, source)
    try:
        config = ModelConfig.from_dict(fields)
        config.validate()
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{source}: cfg['model'] does not describe a model this project builds: {e}") from None
    return config


def _check_upstream_fields(fields: Mapping[str, Any], source: str) -> None:
    dim = fields.get("decoder_embed_dim")
    for name in ("decoder_input_dim", "decoder_output_dim"):
        if fields.get(name) not in (None, dim):
            raise ConversionError(
                f"{source}: cfg['model'].{name}={fields[name]} differs from decoder_embed_dim={dim} "
                "(OPT-350m's project_in_dim/project_out_dim variant), which is not supported yet"
            )
    refusals = [
        ("decoder_normalize_before", False, "post-LayerNorm blocks (OPT-350m's variant)"),
        ("share_decoder_input_output_embed", False, "an output projection not tied to the token embedding"),
        ("decoder_learned_pos", False, "sinusoidal positions instead of learned ones"),
    ]
    for name, bad, what in refusals:
        if name in fields and fields[name] is bad:
            raise ConversionError(f"{source}: cfg['model'].{name}={bad} means {what}, which is not supported")
    activation = fields.get("activation_fn")
    if activation not in (None, "relu"):
        raise ConversionError(f"{source}: cfg['model'].activation_fn={activation!r}; only 'relu' (OPT's) is supported")


def check_supported_state(state: Mapping[str, Any], *, source: str) -> None:
    """Refuse weights of OPT-350m's variant (`decoder.project_in_dim` / `project_out_dim`)."""
    for key in _PROJECTION_KEYS:
        if any(str(k).endswith(key) for k in state):
            raise ConversionError(
                f"{source}: the weights hold '{key}' (OPT-350m's project_in_dim/project_out_dim variant), "
                "which is not supported yet"
            )


def _vocab_from_state(state: Mapping[str, Any] | None, source: str) -> int:
    weight = None if state is None else state.get(EMBED_TOKENS)
    if weight is None:
        raise ConversionError(f"{source}: cfg['model'] has no vocab_size and the weights no '{EMBED_TOKENS}'")
    return int(weight.shape[0])


def is_opt_exact(config: ModelConfig) -> bool:
    """What Hugging Face's OPTForCausalLM computes: no embedding scale, positions at row t + 2."""
    return config.no_scale_embedding and config.position_offset == 2


def model_parallel_size(cfg: Any) -> int:
    """`cfg["common"].model_parallel_size` of a checkpoint's cfg (a dict or Namespace); 1 when absent."""
    size = cfg_value(cfg, "common", "model_parallel_size")
    return 1 if size is None else int(size)


def merge_parts_command(part_file: str) -> str:
    """The reshard_model_parallel command that merges the parts of `part_file`'s set into one consolidated file,
    `DIR/merged/reshard-model_part-0.pt` (DIR: the folder of `part_file`)."""
    name = os.path.basename(part_file)
    pattern = re.sub(r"model_part-\d+", "model_part-*", name)
    pattern = re.sub(r"-shard\d+\.pt$", "-shard*.pt", pattern)
    folder = os.path.dirname(part_file) or "."
    return (f"python -m metaseq.scripts.reshard_model_parallel --input '{os.path.join(folder, pattern)}' "
            f"--output '{os.path.join(folder, 'merged', 'reshard-model_part-{j}.pt')}' --num-output-parts 1 "
            "--unflatten-weights True --skip-optimizer-state True")
