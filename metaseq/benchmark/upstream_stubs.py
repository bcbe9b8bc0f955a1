"""Stand-ins for upstream metaseq classes that real OPT checkpoints pickle, used only to WRITE such files.

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
"""
from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Iterator

import numpy as np

__all__ = ["UPSTREAM_MODULE", "LockingArray", "upstream_classes"]

UPSTREAM_MODULE = "metaseq.data.document_to_sequence"


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
