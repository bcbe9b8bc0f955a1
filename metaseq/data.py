"""Line-per-example text data with a resumable, world-size independent order.

Every non-empty line becomes one example `[BOS] bytes [EOS]`, truncated to
`seq_len + 1` tokens and right-padded with PAD. The global order is a seeded
permutation per epoch; the data position is just the number of samples consumed,
so resuming (at any world size) continues with exactly the same sequences.
"""
from __future__ import annotations

from pathlib import Path

import torch

from metaseq.tokenizer import PAD, encode

__all__ = ["LineDataset", "load_lines"]


def load_lines(path: str | Path) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line]


class LineDataset:
    def __init__(self, lines: list[str], seq_len: int, seed: int):
        if not lines:
            raise ValueError("the data file has no non-empty lines")
        rows = [encode(line, bos=True, eos=True)[: seq_len + 1] for line in lines]
        self.tokens = torch.full((len(rows), seq_len + 1), PAD, dtype=torch.long)  # (E, T+1)
        for i, row in enumerate(rows):
            self.tokens[i, : len(row)] = torch.tensor(row)
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.tokens.size(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self), generator=g)
        return self._orders[epoch]

    def global_batch(self, samples_seen: int, batch_size: int) -> torch.Tensor:
        """The `batch_size` examples that follow position `samples_seen`: (B, T+1)."""
        idx = []
        for i in range(samples_seen, samples_seen + batch_size):
            epoch, j = divmod(i, len(self))
            idx.append(int(self._epoch_order(epoch)[j]))
        return self.tokens[idx]
