"""A small decoder-only OPT-style transformer language model.

Parameter names follow metaseq/OPT (`decoder.embed_tokens.weight`,
`decoder.layers.{k}.self_attn.q_proj.weight`, ...), so checkpoints look like the
real thing. The output projection is tied to the token embedding.

The model computes what OPT (and Hugging Face's `OPTForCausalLM`) computes: token
embeddings are not scaled (`no_scale_embedding`), and learned positions come from
a table of `max_target_positions + 2` rows where position t uses row t + 2
(`position_offset`; rows 0 and 1 are unused but kept, as in OPT). Checkpoints
written before these fields existed hold the earlier variant (embeddings scaled
by sqrt(embed dim), no offset); `ModelConfig.from_dict` reads them as that. Default sizes
are deliberately awkward (embed dim 30, ffn 71, 67 positions, 260 tokens) so that
FSDP has to pad its flat parameters at most world sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from metaseq.tokenizer import VOCAB_SIZE

__all__ = [
    "INIT_STD",
    "PRE_OPT_EXACT",
    "ModelConfig",
    "TransformerLanguageModel",
    "build_model",
    "causal_attention",
    "weights_mismatch",
    "self_attention",
    "embed",
    "init_named_weight_",
    "init_qkv_weight_",
]

INIT_STD = 0.05

# What a cfg["model"] without `no_scale_embedding` means: written before the model was OPT-exact.
PRE_OPT_EXACT = {"no_scale_embedding": False, "position_offset": 0}


@dataclass
class ModelConfig:
    decoder_layers: int = 2
    decoder_embed_dim: int = 30
    decoder_attention_heads: int = 3
    decoder_ffn_embed_dim: int = 71
    max_target_positions: int = 67
    vocab_size: int = VOCAB_SIZE
    no_scale_embedding: bool = True  # metaseq's flag; False: token embeddings times sqrt(embed dim)
    position_offset: int = 2  # position t uses row t + offset of the learned position table
    fused_qkv: bool = False  # one qkv_proj ([q; k; v] on dim 0) instead of q_proj, k_proj, v_proj

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | argparse.Namespace) -> "ModelConfig":
        """Unknown keys are ignored. A dict without `no_scale_embedding` is a checkpoint
        written before the OPT-exact change and gets `PRE_OPT_EXACT`; one with it but
        without `position_offset` (upstream metaseq's cfg) gets OPT's offset 2. An
        `argparse.Namespace` is upstream metaseq's cfg (real OPT): OPT-exact unless its
        `no_scale_embedding` says otherwise; it has no `vocab_size` (see
        `metaseq.hf.model_config_from_cfg`, which takes it from the weights)."""
        if isinstance(d, argparse.Namespace):
            d = {"no_scale_embedding": True, **vars(d)}
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in d.items() if k in names}
        if "no_scale_embedding" not in known:
            known = {**PRE_OPT_EXACT, **known}
        return cls(**known)

    def validate(self) -> None:
        if self.decoder_embed_dim % self.decoder_attention_heads:
            raise ValueError(
                f"--decoder-embed-dim={self.decoder_embed_dim} is not divisible by "
                f"--decoder-attention-heads={self.decoder_attention_heads}; pick a divisor"
            )
        if self.position_offset < 0:
            raise ValueError(f"position_offset={self.position_offset} must be >= 0 (OPT uses 2)")

    def check_sequence_length(self, length: int) -> None:
        """Refuse a forward pass over more tokens than the position table holds."""
        if length > self.max_target_positions:
            raise ValueError(
                f"sequence of {length} tokens is longer than the model's "
                f"max_target_positions={self.max_target_positions}"
            )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """q, k, v (B, T, C) holding `heads` heads side by side -> (B, T, C)."""
    B, T, C = q.shape
    # (B, T, C) -> (B, H, T, C/H)
    q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(B, T, C)


def self_attention(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An attention block of either layout (one `qkv_proj`, or `q_proj`/`k_proj`/`v_proj`), then `out_proj`."""
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj(x).chunk(3, dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return attn.out_proj(causal_attention(q, k, v, attn.heads))


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, fused_qkv: bool = False):
        super().__init__()
        self.heads = heads
        if fused_qkv:
            self.qkv_proj = nn.Linear(dim, 3 * dim)  # weight rows [q; k; v]
        else:
            self.q_proj = nn.Linear(dim, dim)
            self.k_proj = nn.Linear(dim, dim)
            self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self_attention(self, x)


class DecoderLayer(nn.Module):
    """Pre-LayerNorm block, as in OPT."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.decoder_embed_dim
        self.self_attn = SelfAttention(dim, cfg.decoder_attention_heads, cfg.fused_qkv)
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
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
        self.position_offset = cfg.position_offset
        self.embed_tokens = nn.Embedding(cfg.vocab_size, dim)
        # OPT: max_target_positions + 2 rows, position t at row t + 2.
        self.embed_positions = nn.Embedding(cfg.max_target_positions + cfg.position_offset, dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(dim)
        self.output_projection = nn.Linear(dim, cfg.vocab_size, bias=False)
        # Tied: one tensor, two names. FSDP records the tie in shared_param_info.
        self.output_projection.weight = self.embed_tokens.weight
        # fairseq/metaseq keep a version buffer; it makes buffers part of the format.
        self.register_buffer("version", torch.tensor([3.0]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = embed(self, tokens)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.output_projection(self.layer_norm(x))  # (B, T, V)


def embed(decoder: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) -> token embeddings (scaled unless no_scale_embedding) plus positions (B, T, C).

    `decoder` has `embed_tokens`, `embed_positions`, `embed_scale` and `position_offset`
    (the plain and the model-parallel decoder both do).
    """
    positions = torch.arange(tokens.size(1), device=tokens.device) + decoder.position_offset
    x = decoder.embed_tokens(tokens)  # (B, T, C)
    if decoder.embed_scale != 1.0:
        x = decoder.embed_scale * x
    return x + decoder.embed_positions(positions)


class TransformerLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        """`seed`: see `init_named_weight_`; None draws one from torch's global RNG."""
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.decoder = TransformerDecoder(cfg)
        _init_weights(self, _base_seed(seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V)."""
        self.cfg.check_sequence_length(tokens.size(1))
        return self.decoder(tokens)


def _base_seed(seed: int | None) -> int:
    if seed is not None:
        return seed
    return int(torch.empty((), dtype=torch.int64, device="cpu").random_())  # cpu even under a meta device context


def init_named_weight_(weight: torch.Tensor, name: str, seed: int) -> torch.Tensor:
    """Fill the FULL weight called `name` (e.g. `decoder.layers.0.fc1.weight`) with N(0, INIT_STD) numbers
    drawn from a generator seeded by (seed, name) only.

    So a weight's initial value depends neither on the order in which modules are built nor on
    model parallelism: fairscale's parallel layers call this on the full master weight and keep
    their slice, and get the same model as the plain one at any model-parallel size.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    with torch.no_grad():
        return weight.normal_(mean=0.0, std=INIT_STD, generator=generator)


def init_qkv_weight_(weight: torch.Tensor, attn_name: str, seed: int) -> torch.Tensor:
    """A fused qkv weight (3C, C) as the blocks [q; k; v], each drawn like q_proj/k_proj/v_proj: a
    fused model starts as the same function as the separate one of the same seed."""
    for block, part in zip(weight.chunk(3, dim=0), ("q_proj", "k_proj", "v_proj")):
        init_named_weight_(block, f"{attn_name}.{part}.weight", seed)
    return weight


def _init_weights(model: nn.Module, seed: int) -> None:
    """Linear and embedding weights by name, biases zero, layer norms as built; meta tensors are left alone."""
    if any(p.is_meta for p in model.parameters()):
        return
    done: set[int] = set()  # a tied weight is drawn once, under its first name
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or id(module.weight) in done:
            continue
        done.add(id(module.weight))
        if name.endswith(".qkv_proj"):
            init_qkv_weight_(module.weight, name.rsplit(".", 1)[0], seed)
        else:
            init_named_weight_(module.weight, f"{name}.weight", seed)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, seed: int | None = None) -> TransformerLanguageModel:
    """Build the model; with `seed`, the initial weights depend only on the seed (and the names)."""
    return TransformerLanguageModel(cfg, seed=seed)


def weights_mismatch(cfg: ModelConfig, shapes: Mapping[str, Sequence[int]], *, whole_state: bool = True) -> str | None:
    """Why weights of these names and shapes are not `TransformerLanguageModel(cfg)`'s (built on meta), or None.

    With `whole_state` they must be its whole state dict; without, its parameters (each tied one under its first
    name), its buffers and the tied copies being optional, as FSDP's flat parameters hold them."""
    with torch.device("meta"):
        model = TransformerLanguageModel(cfg)
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    required = expected if whole_state else dict(model.named_parameters())
    model_text = "the model its config describes"
    if extra := [name for name in shapes if name not in expected]:
        return f"the weights hold '{extra[0]}' ({len(extra)} name(s) in all), which {model_text} has not"
    if missing := [name for name in required if name not in shapes]:
        return f"the weights lack '{missing[0]}' ({len(missing)} name(s) in all), which {model_text} has"
    for name, shape in shapes.items():
        if list(shape) != expected[name]:
            return f"'{name}' is {list(shape)} in the weights but {expected[name]} in {model_text}"
    return None
