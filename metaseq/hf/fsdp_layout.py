"""The `shard_metadata` that fairscale FSDP reports for this project's model, computed without FSDP.

`metaseq.distributed.fsdp.wrap_model_fsdp` wraps every decoder layer in its own
FSDP instance inside a root instance, all with `flatten_parameters=True`. fairscale's
FlattenParamsWrapper then lists, per instance, the parameters of the modules it owns
(nested instances excluded) in `named_modules()` order, each module's own parameters
in registration order, a tied parameter once (under its first name) with the tie in
`shared_param_info` as (first name, other name). Names are relative to the instance.
A consolidated (unflattened) file carries this metadata with every padding 0, which
is what lets `reshard_fsdp` cut it into raw shards for any world size.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from metaseq.models.transformer_lm import ModelConfig, TransformerLanguageModel

__all__ = ["LAYER_PREFIX", "fsdp_shard_metadata"]

LAYER_PREFIX = "decoder.layers."


def fsdp_shard_metadata(config: ModelConfig) -> dict[str, Any]:
    """`local_metadata_dict()` of a 1-rank FSDP run of `build_model(config)` (no data is allocated)."""
    with torch.device("meta"):
        model = TransformerLanguageModel(config)
    instances = [("", model)] + [(f"{LAYER_PREFIX}{k}", layer) for k, layer in enumerate(model.decoder.layers)]
    return {
        "param_metadata": [_instance_metadata(path, module) for path, module in instances],
        "buffer_names": [name for name, _ in model.named_buffers()],
    }


def _instance_metadata(fsdp_path: str, module: nn.Module) -> dict[str, Any]:
    names, shapes, shared = [], [], []
    first_name: dict[int, str] = {}
    for module_name, sub in module.named_modules():
        if fsdp_path == "" and module_name.startswith(LAYER_PREFIX):
            continue  # owned by a nested instance
        for param_name, param in sub.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in first_name:
                if (first_name[id(param)], name) not in shared:
                    shared.append((first_name[id(param)], name))
                continue
            first_name[id(param)] = name
            names.append(name)
            shapes.append(param.shape)
    return {
        "fsdp_path": fsdp_path,
        "params": {"flat_param_0": {
            "names": names,
            "shapes": shapes,
            "numels": [s.numel() for s in shapes],
            "padding": 0,
        }},
        "no_broadcast_optim_state": False,
        "shared_param_info": shared,
    }
