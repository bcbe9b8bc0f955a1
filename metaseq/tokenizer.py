"""Byte-level tokenizer: no vocabulary file to download.

Ids 0..3 are special (BOS, PAD, EOS, UNK, fairseq's order); byte b is id b + 4.
"""
from __future__ import annotations

__all__ = ["BOS", "PAD", "EOS", "UNK", "VOCAB_SIZE", "encode", "decode"]

BOS, PAD, EOS, UNK = 0, 1, 2, 3
NUM_SPECIAL = 4
VOCAB_SIZE = 256 + NUM_SPECIAL


def encode(text: str, *, bos: bool = True, eos: bool = False) -> list[int]:
    ids = [b + NUM_SPECIAL for b in text.encode("utf-8")]
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])


def decode(ids: list[int]) -> str:
    """Special tokens are dropped; invalid UTF-8 is replaced, never raised."""
    data = bytes(i - NUM_SPECIAL for i in ids if NUM_SPECIAL <= i < VOCAB_SIZE)
    return data.decode("utf-8", errors="replace")
