"""A small decoder-only OPT-style transformer language model.

Parameter names follow metaseq/OPT (`decoder.embed_tokens.weight`,
`decoder.layers.{k}.self_attn.q_proj.weight`, ...), so checkpoints look like the
real thing. The output projection is tied to the token embedding. Default sizes
are deliberately awkward (embed dim 30, ffn 71, 67 positions, 260 tokens) so that
FSDP has to pad its flat parameters at most world sizes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metaseq.tokenizer import VOCAB_SIZE

__all__ = ["ModelConfig", "TransformerLanguageModel", "build_model"]


@dataclass
class ModelConfig:
    decoder_layers: int = 2
    decoder_embed_dim: int = 30
    decoder_attention_heads: int = 3
    decoder_ffn_embed_dim: int = 71
    max_target_positions: int = 67
    vocab_size: int = VOCAB_SIZE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def validate(self) -> None:
        if self.decoder_embed_dim % self.decoder_attention_heads:
            raise ValueError(
                f"--decoder-embed-dim={self.decoder_embed_dim} is not divisible by "
                f"--decoder-attention-heads={self.decoder_attention_heads}; pick a divisor"
            )


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (
            proj(x).view(B, T, self.heads, C // self.heads).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))


class DecoderLayer(nn.Module):
    """Pre-LayerNorm block, as in OPT."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.self_attn = SelfAttention(dim, cfg.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, cfg.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_embed_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class TransformerDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.embed_scale = math.sqrt(dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, dim)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(dim)
        self.output_projection = nn.Linear(dim, cfg.vocab_size, bias=False)
        # Tied: one tensor, two names. FSDP records the tie in shared_param_info.
        self.output_projection.weight = self.embed_tokens.weight
        # fairseq/metaseq keep a version buffer; it makes buffers part of the format.
        self.register_buffer("version", torch.tensor([3.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device)
        x = self.embed_scale * self.embed_tokens(tokens) + self.embed_positions(positions)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.output_projection(self.layer_norm(x))  # (B, T, V)


class TransformerLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.decoder = TransformerDecoder(cfg)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V)."""
        if tokens.size(1) > self.cfg.max_target_positions:
            raise ValueError(
                f"sequence of {tokens.size(1)} tokens is longer than the model's "
                f"max_target_positions={self.cfg.max_target_positions}"
            )
        return self.decoder(tokens)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.05)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, seed: int | None = None) -> TransformerLanguageModel:
    """Build the model; with `seed`, the initial weights depend only on the seed."""
    if seed is not None:
        torch.manual_seed(seed)
    return TransformerLanguageModel(cfg)
