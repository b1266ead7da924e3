"""Parameter counts and training FLOPs per token, from the shape alone (no model is built)."""

from __future__ import annotations

from .args import ModelArgs


def param_count(args: ModelArgs) -> int:
    """Exact number of parameters of `Transformer(args)` (tied embeddings counted once)."""
    hd = args.head_dim
    attn = args.dim * args.n_heads * hd * 2 + args.dim * args.kv_heads * hd * 2
    ffn = 3 * args.dim * args.ffn_dim
    norms = 2 * args.dim
    emb = args.vocab_size * args.dim
    out = 0 if args.tie_embeddings else args.vocab_size * args.dim
    return emb + out + args.n_layers * (attn + ffn + norms) + args.dim


def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in matrix multiplies (embedding lookups and norms do not)."""
    hd = args.head_dim
    per_layer = args.dim * args.n_heads * hd * 2 + args.dim * args.kv_heads * hd * 2 + 3 * args.dim * args.ffn_dim
    return args.n_layers * per_layer + args.vocab_size * args.dim  # the output projection


def train_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 x matmul params plus the attention term.

    Attention scores and the weighted sum are two (seq x head_dim) matmuls per head per layer;
    with a causal mask half of them are needed, and dense kernels often do them all, so we
    count the causal half as PaLM's appendix B does: 6 * n_layers * seq_len * dim.
    """
    return 6.0 * matmul_params(args) + 6.0 * args.n_layers * seq_len * args.n_heads * args.head_dim
