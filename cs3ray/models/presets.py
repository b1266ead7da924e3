"""Named model shapes, from CI-sized to the shapes of 7B/70B/400B models (for planning)."""

from __future__ import annotations

from .args import ModelArgs

# Vocabulary is padded to a multiple of 8 for matmul-friendly shapes; the byte tokenizer
# needs 259 ids. The large presets keep the vocabularies of the models they mirror.
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=192, n_layers=4, n_heads=6, ffn_dim=512, vocab_size=264, max_seq_len=256),
    "small": ModelArgs(dim=768, n_layers=8, n_heads=12, ffn_dim=2048, vocab_size=264, max_seq_len=256),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, vocab_size=32000,
                    max_seq_len=4096, tie_embeddings=False),
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000,
                     max_seq_len=4096, tie_embeddings=False),
    "400b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
}
