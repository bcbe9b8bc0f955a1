"""Tokenizers for inference and export: this project's byte tokenizer, GPT-2 BPE, and HF folders.

Every tokenizer here has the interface `GeneratorInterface` uses: `encode(text)` gives
the prompt's ids with the model's start token, `decode(ids)` drops special tokens, and
`newline_ids` are the ids whose text holds a newline (where greedy answers stop).

- `ByteTokenizer`: `metaseq.tokenizer` (ids 0..3 special, byte b -> b + 4, BOS first).
- `BPETokenizer.from_vocab_merges(vocab, merges)`: real OPT's GPT-2 byte-level BPE as metaseq
  takes it (`--vocab-filename gpt2-vocab.json --merges-filename gpt2-merges.txt`), whose
  ids already are metaseq's dictionary ids (`<s> <pad> </s> <unk>` = 0..3). Prompts start
  with `</s>`, OPT's document separator, as Hugging Face's OPT tokenizer does.
- `BPETokenizer.from_hf_folder(dir)`: a folder with `tokenizer.json` (or `vocab.json` +
  `merges.txt`) and optionally `tokenizer_config.json` (`bos_token`, `split_special_tokens`).

`byte_tokenizer_files(max_len)` gives `tokenizer.json` + `tokenizer_config.json` that make
`AutoTokenizer.from_pretrained` reproduce `metaseq.tokenizer.encode` (BOS included) exactly.
The `tokenizers` package (the `hf` extra) is imported only when a BPE tokenizer is built.
"""
from __future__ import annotations

import json
import os
from typing import Any, Protocol, Sequence

from metaseq import tokenizer as byte_tok
from metaseq.hf.errors import ConversionError

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "TextTokenizer",
    "byte_level_chars",
    "byte_tokenizer_files",
    "require",
]

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3 in metaseq's dictionary order


class TextTokenizer(Protocol):
    newline_ids: frozenset[int]
    vocab_size: int  # ids 0..vocab_size-1; a model must have at least as many tokens

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """This project's byte tokenizer (`metaseq.tokenizer`) behind the `TextTokenizer` interface."""

    newline_ids = frozenset({byte_tok.NUM_SPECIAL + ord("\n")})
    vocab_size = byte_tok.VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return byte_tok.encode(text, bos=True)

    def decode(self, ids: Sequence[int]) -> str:
        return byte_tok.decode(list(ids))


def require(module: str) -> Any:
    """Import a package of the `hf` extra, or raise a one-line ConversionError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConversionError(
            f"the Python package '{module}' is not installed; install the hf extra: pip install -e '.[hf]' "
            "(make install does)"
        ) from None


class BPETokenizer:
    """A `tokenizers.Tokenizer` with a start id prepended to every prompt."""

    def __init__(self, tok: Any, start_id: int, *, source: str):
        self.tok = tok
        self.start_id = start_id
        self.source = source
        self.vocab_size = tok.get_vocab_size()  # added tokens included
        texts = tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=True)
        self.newline_ids = frozenset(i for i, text in enumerate(texts) if "\n" in text)

    @classmethod
    def from_vocab_merges(cls, vocab: str, merges: str) -> "BPETokenizer":
        """GPT-2 byte-level BPE from metaseq's `gpt2-vocab.json` and `gpt2-merges.txt` (OPT's)."""
        tk = require("tokenizers")
        for flag, path in (("--vocab-filename", vocab), ("--merges-filename", merges)):
            if not os.path.isfile(path):
                raise ConversionError(f"{flag} {path}: no such file")
        try:
            model = tk.models.BPE.from_file(vocab, merges)
        except Exception as e:  # malformed JSON or merges
            raise ConversionError(f"--vocab-filename {vocab} / --merges-filename {merges}: cannot read them ({e})") from None
        tok = tk.Tokenizer(model)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        _check_dictionary_ids(tok, f"--vocab-filename {vocab}")
        tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        tok.encode_special_tokens = True  # a literal "</s>" in a prompt stays text, as in metaseq
        return cls(tok, tok.token_to_id("</s>"), source=vocab)

    @classmethod
    def from_hf_folder(cls, folder: str) -> "BPETokenizer":
        """`tokenizer.json` (or `vocab.json` + `merges.txt`) and `tokenizer_config.json` of an HF folder."""
        tk = require("tokenizers")
        config = _read_json(os.path.join(folder, "tokenizer_config.json"), missing_ok=True)
        path = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(path):
            try:
                tok = tk.Tokenizer.from_file(path)
            except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
                raise ConversionError(f"--hf-tokenizer {folder}: cannot read {path} ({e}); is the file complete? "
                                      "copy the tokenizer folder again") from None
        elif os.path.isfile(os.path.join(folder, "vocab.json")):
            return _hf_vocab_merges(folder, config)
        else:
            raise ConversionError(f"--hf-tokenizer {folder}: no tokenizer.json (or vocab.json and merges.txt) there")
        tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        return cls(tok, _start_id(tok, config, folder), source=folder)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.start_id] + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def _hf_vocab_merges(folder: str, config: dict[str, Any]) -> BPETokenizer:
    bpe = BPETokenizer.from_vocab_merges(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
    bpe.start_id = _start_id(bpe.tok, config, folder)
    bpe.tok.encode_special_tokens = bool(config.get("split_special_tokens", True))
    return bpe


def _start_id(tok: Any, config: dict[str, Any], folder: str) -> int:
    bos = config.get("bos_token", "<s>")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    start = tok.token_to_id(bos) if isinstance(bos, str) else None
    if start is None:
        raise ConversionError(f"--hf-tokenizer {folder}: its bos_token {bos!r} is not in its vocabulary")
    return start


def _check_dictionary_ids(tok: Any, what: str) -> None:
    found = [tok.id_to_token(i) for i in range(len(SPECIAL_TOKENS))]
    if found != list(SPECIAL_TOKENS):
        raise ConversionError(
            f"{what}: ids 0..3 are {found}, not {list(SPECIAL_TOKENS)}; pass metaseq's OPT vocabulary "
            "(gpt2-vocab.json with metaseq's dictionary ids), not the original GPT-2 encoder.json"
        )


def _read_json(path: str, *, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(found, dict):
        raise ConversionError(f"{path}: holds a JSON {type(found).__name__}, not an object of tokenizer fields")
    return found


def byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: printable Latin-1 bytes stand for themselves,
    the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + shifted))
            shifted += 1
    return chars


def byte_tokenizer_files(max_len: int) -> dict[str, str]:
    """{file name: text} of `tokenizer.json` and `tokenizer_config.json` for the byte tokenizer.

    A byte-level BPE with no merges: the 256 byte characters are ids 4..259 in byte order,
    so every byte is one token; a template post-processor puts `<s>` first;
    `split_special_tokens` keeps a literal `<s>` in text as its bytes, like `metaseq.tokenizer`.
    """
    tk = require("tokenizers")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: byte_tok.NUM_SPECIAL + b for b, char in enumerate(byte_level_chars())})
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", byte_tok.BOS)]
    )
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "pad_token": "<pad>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
