"""The LM with tensor model parallelism, built from fairscale's own model-parallel layers.

One model part per rank of fairscale's model-parallel group (`initialize_model_parallel`
must have run). Parameter names are the plain model's (`metaseq.models.transformer_lm`),
and merging the P parts with `metaseq.models.partition.merge_state_dicts` gives the plain
model's state dict. The partitioning is upstream metaseq's (see `partition`):

- `decoder.embed_tokens`: `VocabParallelEmbedding` (rows split); the output projection
  is the same Parameter (tied), so every part computes the logits of its vocabulary
  slice, (B, T, V/P), which go to fairscale's `vocab_parallel_cross_entropy`;
- attention `q_proj`/`k_proj`/`v_proj` (or a fused `qkv_proj`, `stride=3`) and `fc1`:
  `ColumnParallelLinear` without gathering, so a part holds H/P heads and FFN/P units;
- `out_proj` and `fc2`: `RowParallelLinear` on the parallel input (bias replicated);
- layer norms, `embed_positions` and the `version` buffer: replicated.

Every weight is drawn by `init_named_weight_` on the full master tensor, so for a
given seed the model is the same function at every model-parallel size. No dropout,
so fairscale's CUDA RNG tracker is never needed (see `metaseq.distributed.cpu_compat`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_model_parallel_world_size,
    vocab_parallel_cross_entropy,
)
from fairscale.nn.model_parallel.mappings import copy_to_model_parallel_region
from torch import nn

from metaseq.models.transformer_lm import ModelConfig, embed, init_named_weight_, init_qkv_weight_, self_attention

__all__ = [
    "ModelParallelTransformerLanguageModel",
    "build_model_parallel",
    "check_model_parallel_sizes",
    "vocab_parallel_loss_sum",
]

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def _named_init(name: str, seed: int) -> InitMethod:
    return lambda weight: init_named_weight_(weight, name, seed)


def check_model_parallel_sizes(cfg: ModelConfig, model_parallel_size: int) -> None:
    """Raise ValueError naming the first size that P does not divide, and the P values that would work."""
    sizes = [
        ("--decoder-attention-heads", cfg.decoder_attention_heads),
        ("--decoder-embed-dim", cfg.decoder_embed_dim),
        ("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),
        ("vocab_size (the tokenizer's)", cfg.vocab_size),
    ]
    common = math.gcd(*(size for _, size in sizes))
    fits = [p for p in range(1, common + 1) if common % p == 0]
    for flag, size in sizes:
        if size % model_parallel_size:
            raise ValueError(
                f"{flag}={size} is not divisible by --model-parallel-size={model_parallel_size}; "
                f"model-parallel sizes this model allows: {', '.join(map(str, fits))} "
                f"(or change the sizes to multiples of {model_parallel_size})"
            )


class ModelParallelSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, name: str, seed: int):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.heads = cfg.decoder_attention_heads // get_model_parallel_world_size()  # this part's heads
        column = dict(gather_output=False)
        if cfg.fused_qkv:
            # Part j holds [q_j; k_j; v_j]: stride 3 slices each block of the master [q; k; v].
            self.qkv_proj = ColumnParallelLinear(
                dim, 3 * dim, stride=3, init_method=lambda w: init_qkv_weight_(w, name, seed), **column
            )
        else:
            for proj in ("q_proj", "k_proj", "v_proj"):
                layer = ColumnParallelLinear(dim, dim, init_method=_named_init(f"{name}.{proj}.weight", seed), **column)
                setattr(self, proj, layer)
        self.out_proj = RowParallelLinear(
            dim, dim, input_is_parallel=True, init_method=_named_init(f"{name}.out_proj.weight", seed)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) replicated -> (B, T, C) replicated; q, k, v are (B, T, C/P)."""
        return self_attention(self, x)


class ModelParallelDecoderLayer(nn.Module):
    """Pre-LayerNorm block, as in OPT; the same names as the plain `DecoderLayer`."""

    def __init__(self, cfg: ModelConfig, name: str, seed: int):
        super().__init__()
        dim, ffn = cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim
        self.self_attn = ModelParallelSelfAttention(cfg, f"{name}.self_attn", seed)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = ColumnParallelLinear(dim, ffn, gather_output=False, init_method=_named_init(f"{name}.fc1.weight", seed))
        self.fc2 = RowParallelLinear(ffn, dim, input_is_parallel=True, init_method=_named_init(f"{name}.fc2.weight", seed))
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class TiedOutputProjection(nn.Module):
    """Holds the token embedding's Parameter under the name `output_projection.weight` (no init of its own)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class ModelParallelDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.position_offset = cfg.position_offset
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, dim, init_method=_named_init("decoder.embed_tokens.weight", seed)
        )
        self.embed_positions = nn.Embedding(cfg.max_target_positions + cfg.position_offset, dim)
        init_named_weight_(self.embed_positions.weight, "decoder.embed_positions.weight", seed)
        self.layers = nn.ModuleList(
            ModelParallelDecoderLayer(cfg, f"decoder.layers.{k}", seed) for k in range(cfg.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(dim)
        self.output_projection = TiedOutputProjection(self.embed_tokens.weight)
        self.register_buffer("version", torch.tensor([3.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = embed(self, tokens)  # (B, T, C), replicated across parts
        for layer in self.layers:
            x = layer(x)
        x = copy_to_model_parallel_region(self.layer_norm(x))  # backward: sum the parts' gradients
        return F.linear(x, self.output_projection.weight)  # (B, T, V/P): this part's vocabulary slice


class ModelParallelTransformerLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        cfg.validate()
        check_model_parallel_sizes(cfg, get_model_parallel_world_size())
        self.cfg = cfg
        self.decoder = ModelParallelDecoder(cfg, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64, the same on every part -> vocab-parallel logits (B, T, V/P)."""
        self.cfg.check_sequence_length(tokens.size(1))
        return self.decoder(tokens)


def build_model_parallel(cfg: ModelConfig, seed: int) -> ModelParallelTransformerLanguageModel:
    """This rank's model part; the full model is the same as `build_model(cfg, seed)`'s at any P."""
    return ModelParallelTransformerLanguageModel(cfg, seed)


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """Summed token cross-entropy from vocab-parallel logits (b, T, V/P) and targets (b, T).

    fairscale's `vocab_parallel_cross_entropy` gives every part the full per-token loss
    (it reduces over the model-parallel group), so the sum is the same on all parts.
    """
    losses = vocab_parallel_cross_entropy(logits.float(), targets)  # (b, T); subtracts the max from logits in place
    return (losses * (targets != ignore_index)).sum()
