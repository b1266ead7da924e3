"""One forward pass over a ragged batch: every row at its own positions in its own cache slot.

It runs the model's own weights (no copies: the q/k/v and w1/w3 projections are re-pointed
at one packed tensor each, so one matmul does what three or two did), so a checkpoint served
here computes what `Transformer.forward` computes; only the bookkeeping differs: rotary
angles and the causal mask are taken per row instead of from one shared cache length.
"""

from __future__ import annotations

import math

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
    """Rotate pairs (x[2i], x[2i+1]) as complex numbers; x (b, t, heads, head_dim), cis (b, t, 1, head_dim/2)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * cis).flatten(-2).to(x.dtype)


@torch.inference_mode()
def ragged_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cache: SlotCache, last: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of the last token of each row (or of column `last[i]` of row i, for right-padded rows).

    tokens, positions: (batch, seq) with positions consecutive per row (a decode step has seq 1,
    a prefill has the prompts, right-padded); slots: (batch,). Keys/values are written to the
    cache first, then every query attends to its own slot's keys at positions <= its own.
    """
    pack(model)
    args = model.args
    b, t = tokens.shape
    nh, nkv, hd = args.n_heads, args.kv_heads, args.head_dim
    cis = torch.complex(model.rope_cos[positions], model.rope_sin[positions]).unsqueeze(2)
    span = int(positions.max()) + 1
    # Key j is visible to a query at position p iff j <= p; later cache entries of a reused
    # slot hold stale keys of an earlier sequence (or a padded prompt's), and the mask keeps them out.
    visible = (torch.arange(span, device=tokens.device).view(1, 1, span) <= positions.unsqueeze(-1)).unsqueeze(1)
    where = cache.index(slots, positions)
    h = model.tok_emb(tokens)
    for i, block in enumerate(model.blocks.values()):
        attn, ffn = block.attn, block.ffn
        x = F.rms_norm(h, (args.dim,), block.attn_norm.weight, block.attn_norm.eps)
        qkv = F.linear(x, _packed(attn.wq)).view(b, t, nh + 2 * nkv, hd)
        qk = _rope(qkv[:, :, :nh + nkv], cis)
        q, k, v = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + nkv:].transpose(1, 2)
        cache.write(i, where, k, v)
        keys, values = cache.read(i, slots, span)
        rep = nh // nkv
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        q = q.to(keys.dtype)  # attention runs in the cache's dtype (fp32 on CPU, see SlotCache)
        if t == 1:
            # A decode step: one query per row; plain matmuls beat the fused kernel at this shape.
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(1.0 / math.sqrt(hd))
            scores.masked_fill_(~visible, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        h = h + attn.wo(out.to(x.dtype).transpose(1, 2).reshape(b, t, -1))
        x = F.rms_norm(h, (args.dim,), block.ffn_norm.weight, block.ffn_norm.eps)
        gate, up = F.linear(x, _packed(ffn.w1)).chunk(2, dim=-1)
        h = h + ffn.w2(F.silu(gate) * up)
    h = h[:, -1] if last is None else h[torch.arange(b, device=h.device), last]
    return model.output(F.rms_norm(h, (args.dim,), model.norm.weight, model.norm.eps))
