"""What upstream metaseq's real OPT checkpoints hold that this project does not define; used only to WRITE such files.

Two things: the cfg layout (`upstream_cfg`), and a stand-in for a class those files pickle.

Rank 0 of an upstream streaming run stores `extra_state["train_iterator"]["tokenization_cache"]`,
the data loader's `metaseq.data.document_to_sequence.LockingArray` (one int32 token count per
document, shared with the loader's workers). Its pickle names that global, which this project
does not define: `metaseq.data` is a plain module here, not a package. Readers must carry
such an object without importing it. To write files that hold it (the benchmark's
`--real-structured` checkpoints, the test fixtures in `tests/real_metaseq.py`), `LockingArray`
below pickles under the upstream name, with upstream's state `(bytes of the int32 array,
number of workers)`, while `upstream_classes()` registers a stand-in module in `sys.modules`:

    with upstream_classes():
        torch.save({"tokenization_cache": LockingArray(np.arange(5), num_workers=2)}, path)
    with upstream_classes():
        ckpt = torch.load(path, weights_only=False)   # LockingArray objects again, == the originals

Nothing in the library imports this module; outside the `with` block the upstream name is
unresolvable, exactly as in a process that reshards a real checkpoint.

`upstream_cfg` is `OmegaConf.to_container(cfg)` of an upstream OPT training run, as each rank
saves it: a plain dict with `_name` in every section, per-rank fields
(`distributed_training.distributed_rank`, `.device_id`, `checkpoint.checkpoint_suffix`), and
`cfg["model"]` / `cfg["criterion"]` as `argparse.Namespace` copies of one args namespace
(upstream's legacy-args conversion) holding the sizes under metaseq's names and no `vocab_size`.
"""
from __future__ import annotations

import argparse
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from metaseq.models.transformer_lm import ModelConfig

__all__ = ["ADAM_BETAS", "ADAM_EPS", "UPSTREAM_MODULE", "WEIGHT_DECAY", "LockingArray", "upstream_cfg",
           "upstream_classes"]

UPSTREAM_MODULE = "metaseq.data.document_to_sequence"
ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1  # OPT's
LOADER_WORKERS, GPUS_PER_NODE = 2, 8


class LockingArray:
    """Upstream's per-document token counts; pickled as `metaseq.data.document_to_sequence.LockingArray`.

    Upstream keeps a `multiprocessing.Array("i", n)` plus one lock per loader worker; its pickled
    state is `(bytes(array), num_workers)`, which this stand-in reproduces (`data` is int32, C int).
    """

    __module__ = UPSTREAM_MODULE
    __qualname__ = "LockingArray"

    def __init__(self, lengths: np.ndarray | list[int], num_workers: int = 1) -> None:
        self.data = np.asarray(lengths, dtype=np.int32)
        self.num_workers = num_workers

    def __getstate__(self) -> tuple[bytes, int]:
        return self.data.tobytes(), self.num_workers

    def __setstate__(self, state: tuple[bytes, int]) -> None:
        all_bytes, num_workers = state
        self.__init__(np.frombuffer(all_bytes, dtype=np.int32).copy(), num_workers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LockingArray):
            return NotImplemented
        return self.num_workers == other.num_workers and np.array_equal(self.data, other.data)

    __hash__ = None  # mutable, compared by value

    def __repr__(self) -> str:
        return f"LockingArray({self.data.size} documents, num_workers={self.num_workers})"


@contextmanager
def upstream_classes() -> Iterator[types.ModuleType]:
    """Make `metaseq.data.document_to_sequence` resolvable (for pickling and unpickling) inside the block.

    Whatever `sys.modules` held under that name before is put back afterwards.
    """
    module = types.ModuleType(UPSTREAM_MODULE, "stand-in: see metaseq.benchmark.upstream_stubs")
    module.LockingArray = LockingArray
    saved = sys.modules.get(UPSTREAM_MODULE)
    sys.modules[UPSTREAM_MODULE] = module
    try:
        yield module
    finally:
        if saved is None:
            sys.modules.pop(UPSTREAM_MODULE, None)
        else:
            sys.modules[UPSTREAM_MODULE] = saved


def upstream_cfg(
    config: ModelConfig,
    *,
    rank: int,
    world_size: int,
    model_parallel_size: int = 1,
    seed: int = 0,
    lr: float = 3e-4,
    seq_len: int = 2048,
    streaming: bool = True,
    ema: bool = False,
    fp16_adam_stats: bool = False,
) -> dict[str, Any]:
    """The cfg global rank `rank` of `world_size` (all ranks, W * P) saves in an upstream OPT run.

    Model part = rank % P. `ModelConfig.from_dict(cfg["model"])` gives back `config` when its
    vocabulary is the default one (upstream's cfg has no `vocab_size`).
    """
    args = _upstream_args(config, model_parallel_size, seq_len)
    criterion = "vocab_parallel_cross_entropy" if model_parallel_size > 1 else "cross_entropy"
    return {
        "_name": None,
        "common": {"_name": None, "log_format": "json", "log_interval": 10, "seed": seed, "fp16": True,
                   "memory_efficient_fp16": True, "bf16": False, "fp16_init_scale": 4, "fp16_scale_window": 256,
                   "min_loss_scale": 1e-4, "model_parallel_size": model_parallel_size, "user_dir": None},
        "distributed_training": {"_name": None, "distributed_world_size": world_size, "distributed_rank": rank,
                                 "distributed_backend": "nccl", "device_id": rank % GPUS_PER_NODE,
                                 "ddp_backend": "fully_sharded", "use_sharded_state": True,
                                 "no_reshard_after_forward": False, "fp32_reduce_scatter": False, "cpu_offload": False},
        "dataset": {"_name": None, "num_workers": LOADER_WORKERS, "batch_size": 2, "train_subset": "train",
                    "valid_subset": "valid", "validate_interval_updates": 1000},
        "optimization": {"_name": None, "max_update": 1000, "clip_norm": 1.0, "update_freq": [1], "lr": [lr]},
        "checkpoint": {"_name": None, "save_dir": "/checkpoint/opt", "restore_file": "checkpoint_last.pt",
                       "save_interval_updates": 100, "checkpoint_suffix": f"-model_part-{rank % model_parallel_size}",
                       "checkpoint_shard_count": 1, "write_checkpoints_asynchronously": True},
        "model": argparse.Namespace(**{**vars(args), "_name": args.arch}),
        "task": {"_name": "streaming_language_modeling" if streaming else "language_modeling",
                 "data": "/data/opt", "tokens_per_sample": seq_len, "sample_break_mode": "none", "seed": seed},
        "criterion": argparse.Namespace(**{**vars(args), "_name": criterion}),
        "optimizer": {"_name": "adam", "adam_betas": str(ADAM_BETAS), "adam_eps": ADAM_EPS,
                      "weight_decay": WEIGHT_DECAY, "use_old_adam": False, "fp16_adam_stats": fp16_adam_stats,
                      "lr": [lr]},
        "lr_scheduler": {"_name": "polynomial_decay", "warmup_updates": 10, "end_learning_rate": 0.0,
                         "zero_lr_warmup_steps": 0, "power": 1.0, "total_num_update": "1000", "lr": [lr]},
        "ema": {"_name": None, "store_ema": ema, "ema_decay": 0.9999, "ema_start_update": 0,
                "ema_seed_model": None, "ema_update_freq": 1, "ema_fp32": ema},
        "bpe": None,
        "tokenizer": None,
    }


def _upstream_args(config: ModelConfig, model_parallel_size: int, seq_len: int) -> argparse.Namespace:
    """The args namespace upstream stores as `cfg["model"]` (and, renamed, `cfg["criterion"]`)."""
    dim = config.decoder_embed_dim
    return argparse.Namespace(
        arch="transformer_lm_megatron", activation_fn="relu", dropout=0.1, attention_dropout=0.1,
        decoder_embed_dim=dim, decoder_input_dim=dim, decoder_output_dim=dim,
        decoder_ffn_embed_dim=config.decoder_ffn_embed_dim, decoder_layers=config.decoder_layers,
        decoder_attention_heads=config.decoder_attention_heads, max_target_positions=config.max_target_positions,
        tokens_per_sample=seq_len, decoder_learned_pos=True, decoder_normalize_before=True,
        no_scale_embedding=config.no_scale_embedding, share_decoder_input_output_embed=True,
        model_parallel_size=model_parallel_size, checkpoint_activations=True, full_megatron_init=True,
        sequence_parallel=False, memory_efficient_fp16=True, ddp_backend="fully_sharded", use_sharded_state=True,
        criterion="vocab_parallel_cross_entropy",
    )
