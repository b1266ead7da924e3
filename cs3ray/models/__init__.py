"""Model definitions: no distributed code here.

The modules that need torch (the transformer and its KV cache) load on first use, so configs and
plans, which only read a model's shape, start without torch.
"""

from typing import Any

from .args import ModelArgs
from .bpe import BPETokenizer, train_bpe
from .flops import matmul_params, param_count, train_flops_per_token
from .presets import PRESETS
from .tokenizer import ByteTokenizer, TokenizerError
from .tokenizer_load import Tokenizer, check_same, load_tokenizer, padded_vocab, tokenizer_from_json

_LAZY = {"KVCache": "transformer", "Transformer": "transformer"}

__all__ = ["BPETokenizer", "ByteTokenizer", "KVCache", "ModelArgs", "PRESETS", "Tokenizer", "TokenizerError",
           "Transformer", "check_same", "load_tokenizer", "matmul_params", "padded_vocab", "param_count",
           "tokenizer_from_json", "train_bpe", "train_flops_per_token"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
