"""A decoder-only transformer (RMSNorm, RoPE, SwiGLU, optional GQA and tied embeddings).

No distributed code lives here: parallelism is applied from the outside by `cs3ray.core`.
The KV cache is an explicit argument so the same forward serves training (no cache),
plain generation and the serving engine (one cache per sequence).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16 has too few mantissa bits for a stable mean of squares.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.to(x.dtype) * self.weight.to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_len, head_dim/2) for rotary position embeddings."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, heads, seq, head_dim), cos/sin (seq, head_dim/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class KVCache:
    """Keys and values of one batch of sequences, grown in place up to `max_len` positions."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        shape = (args.n_layers, batch, args.kv_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v at the current length; return all keys and values so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # Tensor parallel shards wq/wk/wv by output features, so derive local head counts
        # from the actual weight shapes instead of the global config.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = cache.length
            k, v = cache.update(self.layer, k, v)
            # Queries at absolute positions start..start+t-1 see keys 0..their own position.
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(start)
            causal = False
        else:
            mask, causal = None, True
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_emb = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index gives stable names ("blocks.3.attn.wq.weight")
        # that survive per-block wrapping (FSDP, compile, checkpointing).
        self.blocks = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_emb.weight
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        # Not persistent: they are derived from the shape, so checkpoints stay pure weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def _apply(self, fn, recurse: bool = True):
        # `.to(bf16)` / `.half()` cast every floating buffer; the rotary tables stay fp32 (as under
        # autocast in training): a bf16 table rotates late positions by visibly wrong angles.
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32:
            cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual projections scaled by depth."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            scale = std / math.sqrt(2 * self.args.n_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            nn.init.normal_(p, mean=0.0, std=scale)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        start = cache.length if cache is not None else 0
        if start + t > self.args.max_seq_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the model's context of {self.args.max_seq_len}")
        cos, sin = self.rope_cos[start:start + t], self.rope_sin[start:start + t]
        # A pipeline stage holds only some of the modules (cs3ray.core.pipeline): a later stage
        # gets hidden states instead of tokens, and an earlier one returns them.
        h = self.tok_emb(tokens) if self.tok_emb is not None else tokens
        for block in self.blocks.values():
            h = block(h, cos, sin, cache)
        if cache is not None:
            cache.length += t
        return self.output(self.norm(h)) if self.output is not None else h
