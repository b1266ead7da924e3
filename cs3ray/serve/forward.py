"""One forward pass over a ragged batch: every row at its own positions in its own cache slot.

It runs the model's own weights (no copies: the q/k/v and w1/w3 projections are re-pointed
at one packed tensor each, so one matmul does what three or two did), so a checkpoint served
here computes what `Transformer.forward` computes; only the bookkeeping differs: rotary
angles and the causal mask are taken per row instead of from one shared cache length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cs3ray.models import Transformer

from .kv import SlotCache


def pack(model: Transformer) -> Transformer:
    """Re-point each block's wq/wk/wv and w1/w3 weights at views of one packed tensor (idempotent).

    The model computes exactly as before (same values, no extra memory); ragged_forward then
    multiplies by the packed tensors, one matmul per group, which matters when per-op overhead
    dominates a decode step (small models, CPU).
    """
    with torch.no_grad():
        for block in model.blocks.values():
            attn, ffn = block.attn, block.ffn
            for mods in ((attn.wq, attn.wk, attn.wv), (ffn.w1, ffn.w3)):
                first = mods[0].weight
                packed = getattr(first, "_cs3_packed", None)
                if packed is not None and packed.data_ptr() == first.data_ptr():
                    continue  # still packed (a later .to() would have moved the weights off it)
                packed = torch.cat([m.weight for m in mods])
                start = 0
                for m in mods:
                    n = m.weight.shape[0]
                    m.weight.data = packed[start:start + n]
                    start += n
                first._cs3_packed = packed
    return model


def _packed(linear: torch.nn.Linear) -> torch.Tensor:
    return linear.weight._cs3_packed


def _rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) as complex numbers; x (tokens, heads, head_dim), cis (tokens, 1, head_dim/2)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


@dataclass(frozen=True)
class Decode:
    """Rows that each add one token: the token, its position and the row's cache slot, all (rows,)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class Prefill:
    """Whole prompts from position 0: tokens (rows, longest) right-padded, their lengths and slots (rows,)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor


@torch.inference_mode()
def ragged_forward(model: Transformer, cache: SlotCache, decode: Decode | None = None,
                   prefill: Prefill | None = None) -> torch.Tensor:
    """Logits (decode rows, then prefill rows) of the last token of every row, in one pass.

    Decode and prefill rows go through the model together as one flat list of tokens, so an
    engine step that admits a prompt runs the layers' ops once, not twice: on CPU their fixed cost
    is a large share of a decode step (figures: docs/benchmarks.md). Only attention is split: a decode
    row attends to its slot's cached keys at positions <= its own; a prompt attends causally to
    its own keys (its positions start at 0, so the cache holds nothing else it may see). Every
    new key/value is written to the row's slot first. Padding of a shorter prompt writes keys
    past its end; later decode steps overwrite them before anything may see them.
    """
    pack(model)
    args = model.args
    nh, nkv, hd = args.n_heads, args.kv_heads, args.head_dim
    rep = nh // nkv
    device = cache.k.device
    d = 0 if decode is None else decode.tokens.shape[0]
    p, t = (0, 0) if prefill is None else prefill.tokens.shape
    tokens, positions, slots = [], [], []
    if d:
        tokens.append(decode.tokens)
        positions.append(decode.positions)
        slots.append(decode.slots)
    if p:
        tokens.append(prefill.tokens.reshape(-1))
        positions.append(torch.arange(t, device=device).repeat(p))
        slots.append(prefill.slots.repeat_interleave(t))
    tokens_, positions_ = torch.cat(tokens), torch.cat(positions)
    where = cache.index(torch.cat(slots), positions_)
    # The rotation runs in fp32 whatever the model's dtype (torch has no complex bf16; complex
    # fp16 is experimental): _rope casts the rotated q/k back.
    cis = torch.complex(model.rope_cos[positions_].float(), model.rope_sin[positions_].float()).unsqueeze(1)
    if d:
        span = int(decode.positions.max()) + 1
        first = cache.first_of(decode.slots)
        # Additive mask, one row per (sequence, kv head): key j is visible iff j <= position;
        # later entries of a reused slot hold stale keys of an earlier sequence.
        hidden = torch.arange(span, device=device).view(1, span) > decode.positions.view(d, 1)
        bias = torch.zeros(d, span, dtype=cache.k.dtype, device=device).masked_fill_(hidden, float("-inf"))
        bias = bias.unsqueeze(1).expand(d, nkv, span).reshape(d * nkv, 1, span)
    scale = 1.0 / math.sqrt(hd)
    h = model.tok_emb(tokens_)
    for i, block in enumerate(model.blocks.values()):
        attn, ffn = block.attn, block.ffn
        x = F.rms_norm(h, (args.dim,), block.attn_norm.weight, block.attn_norm.eps)
        qkv = F.linear(x, _packed(attn.wq)).view(-1, nh + 2 * nkv, hd)
        qk = _rope(qkv[:, :nh + nkv], cis)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        cache.write(i, where, k, v)
        outs = []
        if d:
            # One query per row: plain batched matmuls (the fused kernel is slower at this shape),
            # grouped by kv head so grouped-query attention needs no repeated keys.
            keys, values = cache.read(i, decode.slots, span, first)
            qd = q[:d].to(keys.dtype).reshape(d * nkv, rep, hd)
            scores = torch.baddbmm(bias, qd, keys.reshape(d * nkv, span, hd).transpose(1, 2), alpha=scale)
            out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(d * nkv, span, hd))
            outs.append(out.view(d, nh * hd).to(x.dtype))
        if p:
            # Attention in the cache's dtype, as decode steps will read these keys later.
            qp, kp, vp = (z[d:].to(cache.k.dtype).view(p, t, -1, hd).transpose(1, 2) for z in (q, k, v))
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=rep > 1)
            outs.append(out.transpose(1, 2).reshape(p * t, nh * hd).to(x.dtype))
        h = h + attn.wo(outs[0] if len(outs) == 1 else torch.cat(outs))
        x = F.rms_norm(h, (args.dim,), block.ffn_norm.weight, block.ffn_norm.eps)
        gate, up = F.linear(x, _packed(ffn.w1)).chunk(2, dim=-1)
        h = h + ffn.w2(F.silu(gate) * up)
    if p:  # each prompt's last real token
        last = d + torch.arange(p, device=device) * t + prefill.lengths - 1
        h = h[torch.cat([torch.arange(d, device=device), last])] if d else h[last]
    return model.output(F.rms_norm(h, (args.dim,), model.norm.weight, model.norm.eps))
