"""Parameter names and tensors between this project's (metaseq's) model and Hugging Face's OPT (pure).

metaseq                                  Hugging Face OPTForCausalLM
decoder.embed_tokens.weight              model.decoder.embed_tokens.weight
decoder.embed_positions.weight           model.decoder.embed_positions.weight   (max positions + 2 rows)
decoder.layers.{i}.<same>                model.decoder.layers.{i}.<same>
decoder.layers.{i}.self_attn.qkv_proj.*  ...self_attn.{q,k,v}_proj.*             (fused: split on dim 0)
decoder.layer_norm.{weight,bias}         model.decoder.final_layer_norm.{weight,bias}
decoder.output_projection.weight         lm_head.weight (tied to the embedding: not stored)
decoder.version                          (a buffer HF does not have)

Tensors are passed through as they are: no copy, no dtype cast, except that the three
blocks of a fused projection become three (contiguous) tensors.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch

from metaseq.hf.errors import ConversionError
from metaseq.hf.variants import EMBED_TOKENS, FUSED_QKV_ORDER_METASEQ, model_parallel_size
from metaseq.models.transformer_lm import ModelConfig, weights_mismatch

__all__ = [
    "OUTPUT_PROJECTION",
    "VERSION_KEY",
    "check_state_matches_model",
    "check_whole_model",
    "from_hf_state_dict",
    "split_fused_qkv",
    "strip_hf_prefix",
    "to_hf_state_dict",
    "tie_and_version",
    "upstream_state_for_model",
]

OUTPUT_PROJECTION = "decoder.output_projection.weight"
VERSION_KEY = "decoder.version"
LM_HEAD = "lm_head.weight"
_RENAMES = {"decoder.layer_norm.weight": "decoder.final_layer_norm.weight",
            "decoder.layer_norm.bias": "decoder.final_layer_norm.bias"}
_FUSED = re.compile(r"^(.*\.self_attn\.)qkv_proj\.(weight|bias)$")


def split_fused_qkv(state: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """`...qkv_proj.{weight,bias}` -> `...{q,k,v}_proj.*`; `order` names the three dim-0 blocks."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = value
            continue
        if value.shape[0] % 3:
            raise ConversionError(f"'{key}' has {value.shape[0]} rows, not three equal q/k/v blocks")
        for name, block in zip(order, value.chunk(3, dim=0)):
            out[f"{match.group(1)}{name}_proj.{match.group(2)}"] = block.contiguous()
    return out


def to_hf_state_dict(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Our unflattened weights (q/k/v already split) -> HF names; drops the tied head and buffers."""
    if EMBED_TOKENS not in state:
        raise ConversionError(f"the weights have no '{EMBED_TOKENS}'; is this an OPT-style language model?")
    head = state.get(OUTPUT_PROJECTION)
    if head is not None and not torch.equal(head, state[EMBED_TOKENS]):
        raise ConversionError(f"'{OUTPUT_PROJECTION}' differs from '{EMBED_TOKENS}'; untied output projections are not supported")
    out = {}
    for key, value in state.items():
        if key in (OUTPUT_PROJECTION, VERSION_KEY):
            continue
        if not key.startswith("decoder."):
            raise ConversionError(f"unexpected weight '{key}': OPT-style weights all start with 'decoder.'")
        out["model." + _RENAMES.get(key, key)] = value
    return out


def strip_hf_prefix(state: Mapping[str, Any], *, source: str = "the weights") -> dict[str, Any]:
    """HF checkpoints name weights `model.decoder...` (OPTForCausalLM) or `decoder...` (OPTModel); a weight under
    both names is refused (which one a loader takes differs)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        name = key[len("model."):] if key.startswith("model.") else key
        if name in out:
            raise ConversionError(f"{source}: '{name}' is there twice, with and without the 'model.' prefix; keep "
                                  "one of them")
        out[name] = value
    return out


def from_hf_state_dict(state: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """HF weights (with or without the `model.` prefix) -> our names, with the tie and version buffer.

    An `lm_head.weight` must equal the token embedding (the head is tied in our model).
    """
    state = strip_hf_prefix(state, source=source)
    head = state.pop(LM_HEAD, None)
    inverse = {v: k for k, v in _RENAMES.items()}
    out = {inverse.get(key, key): value for key, value in state.items()}
    if EMBED_TOKENS not in out:
        raise ConversionError(f"{source}: no 'model.{EMBED_TOKENS}' among the weights; is this an OPT model?")
    if head is not None and not torch.equal(head, out[EMBED_TOKENS]):
        raise ConversionError(
            f"{source}: '{LM_HEAD}' differs from the token embedding (an untied head), which is not supported"
        )
    return tie_and_version(out)


def tie_and_version(state: Mapping[str, Any]) -> dict[str, Any]:
    """Add what our model has and HF's does not: the tied head (the embedding's tensor) and fairseq's version buffer."""
    out = dict(state)
    out.setdefault(OUTPUT_PROJECTION, out[EMBED_TOKENS])
    out.setdefault(VERSION_KEY, torch.tensor([3.0]))
    return out


def check_state_matches_model(config: ModelConfig, state: Mapping[str, Any], *, source: str) -> None:
    """Our names and shapes must be exactly those of `TransformerLanguageModel(config)`."""
    if problem := weights_mismatch(config, {k: v.shape for k, v in state.items()}):
        raise ConversionError(f"{source}: {problem}")


def check_whole_model(config: ModelConfig, state: Mapping[str, Any], cfg: Any, *, source: str, fix: str) -> None:
    """`check_state_matches_model`; weights that do not fit, in a checkpoint whose cfg says P > 1 model parts, are
    one part (a slice of each weight), refused with `fix`. P alone decides nothing: upstream's merged restored.pt
    keeps P > 1 and is whole."""
    try:
        check_state_matches_model(config, state, source=source)
    except ConversionError:
        parts = model_parallel_size(cfg)
        if parts == 1:
            raise
        raise ConversionError(f"{source}: one part of a model-parallel checkpoint (cfg['common'].model_parallel_size="
                              f"{parts}) holds a slice of each weight; {fix}") from None


def upstream_state_for_model(state: Mapping[str, Any]) -> dict[str, Any]:
    """Upstream metaseq's unflattened weights as our model names them: a fused `qkv_proj`
    (K, V, Q blocks) split, and the tied head and version buffer added where the file lacks them."""
    return tie_and_version(split_fused_qkv(state, FUSED_QKV_ORDER_METASEQ))
