"""Model definitions: no distributed code here."""

from .flops import matmul_params, param_count, train_flops_per_token
from .presets import PRESETS
from .tokenizer import ByteTokenizer
from .transformer import KVCache, ModelArgs, Transformer

__all__ = ["ByteTokenizer", "KVCache", "ModelArgs", "PRESETS", "Transformer", "matmul_params",
           "param_count", "train_flops_per_token"]
