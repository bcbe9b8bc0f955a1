"""The options of a reshard run: one frozen dataclass, the only place they are listed.

The command line fills it by field name (flag `--num-output-shards` is field
`num_output_shards`), and every error about an option names its flag.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from metaseq.errors import ReshardError, check_field_types
from metaseq.torchzip import DType, dtype_by_name

__all__ = ["DTYPES", "ReshardOptions"]

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --output-dtype: torch dtype names


@dataclass(frozen=True)
class ReshardOptions:
    """What to reshard into what; validated on construction."""

    input_glob_pattern: str = ""  # files: the shards of one model part, or one consolidated file ('{j}': every part)
    output_shard_name: str = ""  # '{i}': the output shard index, '{j}': the model part
    num_output_shards: int = 1
    num_output_parts: int | None = None  # model parallelism: Q parts (None: each part resharded on its own)
    unflatten_weights: bool = False  # original parameter names and shapes (one output)
    skip_optimizer_state: bool = False
    output_dtype: str | None = None  # a key of DTYPES: floating model weights and buffers only
    drop_metaseq_req: bool = False  # extra_state["train_iterator"] = None
    overwrite: bool = False
    trust_checkpoint: bool = False  # let torch.load run other classes of legacy-format (non-zip) inputs
    verify: bool = False  # CRC32s in, CRC32s out, outputs re-read and compared with the inputs
    dry_run: bool = False
    num_workers: int | None = None  # output files written at once (threads); None: one per CPU
    quiet: bool = False  # no progress

    def __post_init__(self) -> None:
        for name in ("input_glob_pattern", "output_shard_name"):  # a Path too; '~' as the shell would, also quoted
            if isinstance(getattr(self, name), (str, os.PathLike)):
                object.__setattr__(self, name, os.path.expanduser(getattr(self, name)))
        check_field_types(self, ReshardError)
        if self.num_output_shards < 1:
            raise ReshardError(f"--num-output-shards={self.num_output_shards}: must be at least 1")
        if self.unflatten_weights and self.num_output_shards != 1:
            raise ReshardError(
                f"--unflatten-weights needs --num-output-shards=1 (got {self.num_output_shards}); "
                "original parameters cannot be sharded, drop one of the two flags"
            )
        if self.output_dtype is not None and self.output_dtype not in DTYPES:
            raise ReshardError(f"--output-dtype={self.output_dtype}: expected one of {', '.join(DTYPES)}")
        if self.num_output_parts is not None and self.num_output_parts < 1:
            raise ReshardError(f"--num-output-parts={self.num_output_parts}: must be at least 1")
        if self.num_workers is not None and self.num_workers < 1:
            raise ReshardError(f"--num-workers={self.num_workers}: must be at least 1")

    @property
    def dtype(self) -> DType | None:
        """The dtype floating model tensors are cast to, or None."""
        return dtype_by_name(DTYPES[self.output_dtype]) if self.output_dtype else None

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> ReshardOptions:
        """The options among `values` (e.g. `vars(args)`), by field name; other keys are ignored."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
