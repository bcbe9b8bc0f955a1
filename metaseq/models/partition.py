"""How model parallelism cuts the model's full parameters into P parts (upstream metaseq's rules).

A parameter is split along one dimension into P equal slices, part j holding slice j,
or replicated (every part holds all of it):

| parameter (by name) | dim | fairscale layer |
|---|---|---|
| `embed_tokens.weight`, `output_projection.weight` (tied) | 0 | `VocabParallelEmbedding` |
| `q_proj`, `k_proj`, `v_proj`, `fc1` (weight and bias) | 0 | `ColumnParallelLinear` |
| `qkv_proj` (weight and bias), rows `[q; k; v]` | 0, strided | `ColumnParallelLinear(stride=3)` |
| `out_proj.weight`, `fc2.weight` | 1 | `RowParallelLinear` |
| everything else (`out_proj.bias`, `fc2.bias`, layer norms, `embed_positions`, `version`) | - | replicated |

A fused `qkv_proj` is three blocks on dim 0; part j holds `[q_j; k_j; v_j]`, the j-th
slice of each block, which is what `ColumnParallelLinear(C, 3C, stride=3)` keeps of its
master weight. Merging the P parts of a model-parallel state dict gives the plain
(P = 1) model's state dict, names unchanged. `RULES` is the one table: a new
architecture adds rows. Pure functions, no I/O; torch only for the tensor helpers.
"""
from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Mapping, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = [
    "RULES",
    "Rule",
    "merge_param",
    "merge_state_dicts",
    "partition_dim",
    "rule_for",
    "split_param",
    "split_state_dict",
    "strided_blocks",
]


class Rule(NamedTuple):
    """Parameters whose name ends like `pattern` (fnmatch) are cut on `dim` into equal slices per part.

    With `blocks` > 1 the dimension holds that many equal blocks, each sliced separately.
    `what` names the split in errors ("vocabulary rows", "rows", "columns").
    """

    pattern: str
    dim: int
    blocks: int
    what: str


RULES = (  # first match wins; names that match none are replicated
    Rule("*embed_tokens.weight", 0, 1, "vocabulary rows"),  # VocabParallelEmbedding
    Rule("*output_projection.weight", 0, 1, "vocabulary rows"),  # tied to it, or untied: the same cut
    Rule("*qkv_proj.weight", 0, 3, "rows"),  # ColumnParallelLinear(C, 3C, stride=3): [q_j; k_j; v_j]
    Rule("*qkv_proj.bias", 0, 3, "rows"),
    *(Rule(f"*{layer}.{leaf}", 0, 1, "rows") for layer in ("q_proj", "k_proj", "v_proj", "fc1")
      for leaf in ("weight", "bias")),  # ColumnParallelLinear
    Rule("*out_proj.weight", 1, 1, "columns"),  # RowParallelLinear: its bias is replicated
    Rule("*fc2.weight", 1, 1, "columns"),
)


def rule_for(name: str) -> Rule | None:
    """The rule that cuts parameter `name`, or None when every part holds all of it."""
    return next((r for r in RULES if fnmatch.fnmatchcase(name, r.pattern)), None)


def partition_dim(name: str) -> int | None:
    """The dimension along which `name` is split across parts, or None when it is replicated."""
    rule = rule_for(name)
    return None if rule is None else rule.dim


def strided_blocks(name: str) -> int:
    """How many equal blocks on the split dimension are sliced separately: 3 for a fused qkv_proj, else 1."""
    rule = rule_for(name)
    return 1 if rule is None else rule.blocks


def split_param(name: str, full: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """The `parts` slices of the full tensor `name` (the same tensor P times when replicated)."""
    dim = partition_dim(name)
    if dim is None:
        return [full] * parts
    blocks = strided_blocks(name)
    if full.size(dim) % (parts * blocks):
        raise ValueError(f"{name}: size {full.size(dim)} on dim {dim} is not divisible by {parts} parts x {blocks} blocks")
    import torch

    slices = [block.chunk(parts, dim=dim) for block in full.chunk(blocks, dim=dim)]  # [block][part]
    return [torch.cat([s[j] for s in slices], dim=dim) for j in range(parts)]


def merge_param(name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_param`; a replicated tensor must be equal in every part."""
    import torch

    dim = partition_dim(name)
    if dim is None:
        for j, other in enumerate(slices[1:], start=1):
            if not torch.equal(slices[0], other):
                raise ValueError(f"{name} is replicated but part {j} differs from part 0")
        return slices[0]
    blocks = strided_blocks(name)
    per_part = [s.chunk(blocks, dim=dim) for s in slices]  # [part][block]
    return torch.cat([torch.cat([p[b] for p in per_part], dim=dim) for b in range(blocks)], dim=dim)


def split_state_dict(state: Mapping[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """A plain (P = 1) state dict -> one state dict per model part, same names."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(parts)]
    for name, full in state.items():
        for j, piece in enumerate(split_param(name, full, parts)):
            out[j][name] = piece.clone()
    return out


def merge_state_dicts(parts: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict per model part (same names in each) -> the plain (P = 1) state dict."""
    names = list(parts[0])
    for j, part in enumerate(parts[1:], start=1):
        if list(part) != names:
            raise ValueError(f"model part {j} has other names than part 0: {sorted(set(part) ^ set(names))[:4]}")
    return {name: merge_param(name, [p[name] for p in parts]) for name in names}
