"""`config.json` / `generation_config.json` of Hugging Face's OPT, to and from `ModelConfig` (pure)."""
from __future__ import annotations

from typing import Any, Collection, Mapping

import torch

from metaseq.hf.errors import ConversionError
from metaseq.models.transformer_lm import ModelConfig
from metaseq.tokenizer import BOS, EOS, PAD, UNK

__all__ = [
    "DTYPE_NAMES",
    "hf_config",
    "hf_generation_config",
    "model_config_from_hf",
]

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# (HF field, value this project's model computes, what another value would mean)
_REQUIRED = [
    ("do_layer_norm_before", True, "post-LayerNorm blocks (OPT-350m's variant)"),
    ("activation_function", "relu", "another activation than ReLU"),
    ("enable_bias", True, "linear layers without biases"),
    ("layer_norm_elementwise_affine", True, "LayerNorms without weights and biases"),
    ("tie_word_embeddings", True, "an lm_head not tied to the token embedding"),
    ("_remove_final_layer_norm", False, "no final LayerNorm"),
]


def hf_config(config: ModelConfig, dtype: torch.dtype, *, bos: int = BOS) -> dict[str, Any]:
    """OPTForCausalLM's config.json for `config` (OPT-exact); integers stay JSON integers. `bos`: the token prompts
    start with (the byte tokenizer's BOS; EOS `</s>` for OPT's GPT-2 BPE, as Hugging Face's OPT has it)."""
    return {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "vocab_size": int(config.vocab_size),
        "hidden_size": int(config.decoder_embed_dim),
        "word_embed_proj_dim": int(config.decoder_embed_dim),
        "num_hidden_layers": int(config.decoder_layers),
        "num_attention_heads": int(config.decoder_attention_heads),
        "ffn_dim": int(config.decoder_ffn_embed_dim),
        "max_position_embeddings": int(config.max_target_positions),
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "activation_function": "relu",
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
        "bos_token_id": bos,
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "layerdrop": 0.0,
        "init_std": 0.02,
        "use_cache": True,
        "dtype": DTYPE_NAMES[dtype],
    }


def hf_generation_config(config: ModelConfig, *, newline_ids: Collection[int] = (), bos: int = BOS) -> dict[str, Any]:
    """Greedy decoding as `metaseq.cli.interactive_cli` does it by default.

    BOS, PAD and UNK are never generated; EOS and the tokenizer's `newline_ids` stop (pass
    them only when the tokenizer is known: a GPT-2 BPE's newline ids are not 14). Generation stops at
    the model's context (`max_length`); our CLI's `--max-new-tokens` (64) is not carried: pass
    `max_new_tokens=min(64, max_length - prompt_length)` to `generate` for the same cap (a plain
    `max_new_tokens` replaces `max_length`, and positions past the context fail).
    """
    return {
        "do_sample": False,
        "num_beams": 1,
        "bos_token_id": bos,
        "pad_token_id": PAD,
        "eos_token_id": [EOS, *sorted(newline_ids)],
        "suppress_tokens": [BOS, PAD, UNK],
        "max_length": int(config.max_target_positions),
    }


def model_config_from_hf(hf: Mapping[str, Any], *, source: str) -> ModelConfig:
    """The OPT-exact `ModelConfig` of an HF OPT config.json; refuses what our model cannot compute."""
    if hf.get("model_type") != "opt":
        raise ConversionError(f"{source}: model_type is {hf.get('model_type')!r}, not 'opt'; only OPT models convert")
    for name, value, what in _REQUIRED:
        found = hf.get(name, value)
        if found != value:
            raise ConversionError(f"{source}: {name}={found!r} means {what}, which is not supported (needs {value!r})")
    dim = _int_field(hf, "hidden_size", source)
    proj = dim if hf.get("word_embed_proj_dim") is None else hf["word_embed_proj_dim"]  # null: transformers' default
    if proj != dim:
        raise ConversionError(
            f"{source}: word_embed_proj_dim={proj} differs from hidden_size={dim} (OPT-350m's project_in/"
            "project_out variant), which is not supported yet"
        )
    config = ModelConfig(
        decoder_layers=_int_field(hf, "num_hidden_layers", source),
        decoder_embed_dim=dim,
        decoder_attention_heads=_int_field(hf, "num_attention_heads", source),
        decoder_ffn_embed_dim=_int_field(hf, "ffn_dim", source),
        max_target_positions=_int_field(hf, "max_position_embeddings", source),
        vocab_size=_int_field(hf, "vocab_size", source),
        no_scale_embedding=True,
        position_offset=2,
    )
    try:
        config.validate()
    except ValueError as e:  # named as config.json names them, not as training's flags
        text = str(e).replace("--decoder-embed-dim", "hidden_size").replace("--decoder-attention-heads",
                                                                            "num_attention_heads")
        raise ConversionError(f"{source}: {text}") from None
    return config


def _int_field(hf: Mapping[str, Any], name: str, source: str) -> int:
    value = hf.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConversionError(f"{source}: {name} must be a positive integer, found {value!r}")
    return value
