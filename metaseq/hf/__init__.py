"""The Hugging Face bridge: metaseq checkpoints <-> `transformers`' OPT folders (see docs/huggingface.md).

Importing this package needs neither `transformers` nor `safetensors` nor `tokenizers`
(the `hf` extra); the functions that use them import them and say how to install them.
"""
from metaseq.hf.errors import ConversionError
from metaseq.hf.export import convert_to_hf
from metaseq.hf.load import convert_from_hf, read_hf_folder
from metaseq.hf.tokenization import BPETokenizer, ByteTokenizer, TextTokenizer
from metaseq.hf.variants import model_config_from_cfg

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "ConversionError",
    "TextTokenizer",
    "convert_from_hf",
    "convert_to_hf",
    "model_config_from_cfg",
    "read_hf_folder",
]
