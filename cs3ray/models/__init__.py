"""Model definitions: no distributed code here."""

from .bpe import BPETokenizer, train_bpe
from .flops import matmul_params, param_count, train_flops_per_token
from .presets import PRESETS
from .tokenizer import ByteTokenizer, TokenizerError
from .tokenizer_load import Tokenizer, check_same, load_tokenizer, padded_vocab, tokenizer_from_json
from .transformer import KVCache, ModelArgs, Transformer

__all__ = ["BPETokenizer", "ByteTokenizer", "KVCache", "ModelArgs", "PRESETS", "Tokenizer", "TokenizerError",
           "Transformer", "check_same", "load_tokenizer", "matmul_params", "padded_vocab", "param_count",
           "tokenizer_from_json", "train_bpe", "train_flops_per_token"]
