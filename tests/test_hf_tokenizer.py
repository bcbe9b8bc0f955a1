"""The exported byte tokenizer (tokenizer.json + tokenizer_config.json) and the GPT-2 BPE for real OPT."""
import json

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer

from metaseq.hf import BPETokenizer, ByteTokenizer, ConversionError
from metaseq.hf.tokenization import byte_tokenizer_files
from metaseq.tokenizer import NUM_SPECIAL, decode, encode
from training import CORPUS

TEXTS = [
    "what is the meaning of life?",
    "  two leading spaces, trailing tab\t",
    "héllo wörld, 日本語, emoji 🎉, combining e\u0301",
    "controls \x00\x01\x07\x1b[0m\r\n\x7f end",
    "<s>literal</s> special <pad><unk> text",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_tok")
    for name, text in byte_tokenizer_files(67).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_gives_our_ids_with_bos(hf_tokenizer_dir, text):
    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    ids = tok(text)["input_ids"]
    assert ids == encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == decode(ids) == text


def test_every_byte_is_its_own_token(hf_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    assert len(tok) == 256 + NUM_SPECIAL
    assert [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(i)) for i in range(len(tok))] == list(range(len(tok)))
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)


@pytest.mark.parametrize("ids", [
    [NUM_SPECIAL + 0xFF, NUM_SPECIAL + ord("a")],                      # a byte that never starts UTF-8
    [NUM_SPECIAL + 0xE6, NUM_SPECIAL + 0x97, 2, NUM_SPECIAL + ord("b")],  # a cut 3-byte sequence, EOS inside
    [0, 1, 3, NUM_SPECIAL + 0xC3],                                     # specials, then half a character
])
def test_decoding_invalid_utf8_and_specials_matches(hf_tokenizer_dir, ids):
    tok = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    assert tok.decode(ids, skip_special_tokens=True) == decode(ids)
    assert "\ufffd" in decode(ids)


def test_hf_folder_as_inference_tokenizer_equals_the_byte_tokenizer(hf_tokenizer_dir):
    bpe, byte = BPETokenizer.from_hf_folder(str(hf_tokenizer_dir)), ByteTokenizer()
    for text in TEXTS:
        assert bpe.encode(text) == byte.encode(text)
        assert bpe.decode(byte.encode(text)) == byte.decode(byte.encode(text))
    assert bpe.newline_ids == byte.newline_ids == {NUM_SPECIAL + ord("\n")}


def write_gpt2_files(folder, vocab_size=300):
    """A tiny GPT-2-style byte-level BPE with metaseq's dictionary ids (specials 0..3), trained here."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS.read_text().splitlines(), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False)
    vocab_path, merges_path = bpe.save_model(str(folder))
    vocab, merges = folder / "gpt2-vocab.json", folder / "gpt2-merges.txt"
    (folder / "vocab.json").rename(vocab)
    (folder / "merges.txt").rename(merges)
    return str(vocab), str(merges), bpe


def test_gpt2_bpe_from_vocab_and_merges_starts_with_eos_and_round_trips(tmp_path):
    vocab, merges, reference = write_gpt2_files(tmp_path)
    tok = BPETokenizer.from_vocab_merges(vocab, merges)
    text = "what is the meaning of life?\nwhat do cats chase?"
    ids = tok.encode(text)
    assert ids[0] == 2 and ids[1:] == reference.encode(text).ids  # same BPE, OPT's </s> first
    assert len(ids) < len(text.encode())  # merges were applied
    assert tok.decode(ids) == text
    literal = tok.encode("a </s> b")  # stays text, as in metaseq's tokenizer (no added special tokens)
    assert 2 not in literal[1:] and tok.decode(literal) == "a </s> b"
    assert reference.token_to_id("Ċ") in tok.newline_ids


def test_original_gpt2_vocabulary_without_dictionary_ids_is_refused(tmp_path):
    vocab, merges, _ = write_gpt2_files(tmp_path)
    table = json.loads(open(vocab).read())
    table["<s>"], table["!"] = table["!"], table["<s>"]  # "<s>" no longer id 0
    open(vocab, "w").write(json.dumps(table))
    with pytest.raises(ConversionError, match=r"--vocab-filename .*ids 0..3 are .*not \['<s>', '<pad>', '</s>', '<unk>'\]"):
        BPETokenizer.from_vocab_merges(vocab, merges)
    with pytest.raises(ConversionError, match="--merges-filename .*nope.txt: no such file"):
        BPETokenizer.from_vocab_merges(vocab, str(tmp_path / "nope.txt"))
