"""One forward pass over a ragged batch: every row at its own positions in its own cache slot.

It reuses the model's own modules and RoPE tables (no copied weights), so a checkpoint served
here computes exactly what `Transformer.forward` computes; only the bookkeeping differs: rotary
angles and the causal mask are taken per row instead of from one shared cache length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cs3ray.models import Transformer
from cs3ray.models.transformer import apply_rope

from .kv import SlotCache


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # apply_rope broadcasts (seq, half) tables; per-row tables (batch, seq, half) need a head axis.
    return apply_rope(x, cos.unsqueeze(1), sin.unsqueeze(1))


@torch.inference_mode()
def ragged_forward(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   cache: SlotCache) -> torch.Tensor:
    """Logits of the last token of each row.

    tokens, positions: (batch, seq) with positions consecutive per row (a decode step has seq 1,
    a prefill has the prompt); slots: (batch,). Keys/values are written to the cache first, then
    every query attends to its own slot's keys at positions <= its own.
    """
    b, t = tokens.shape
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    span = int(positions.max()) + 1
    # Key j is visible to a query at position p iff j <= p; later cache entries of a reused
    # slot hold stale keys of an earlier sequence, and the mask is what keeps them out.
    mask = (torch.arange(span, device=tokens.device).view(1, 1, span) <= positions.unsqueeze(-1)).unsqueeze(1)
    h = model.tok_emb(tokens)
    for i, block in enumerate(model.blocks.values()):
        attn = block.attn
        x = block.attn_norm(h)
        q = attn.wq(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
        k = attn.wk(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
        v = attn.wv(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
        q, k = _rope_rows(q, cos, sin), _rope_rows(k, cos, sin)
        cache.write(i, slots, positions, k, v)
        keys, values = cache.read(i, slots, span)
        rep = q.shape[1] // keys.shape[1]
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        # Attention runs in the cache's dtype (fp32 on CPU, see SlotCache), the projections in the model's.
        out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask).to(x.dtype)
        h = h + attn.wo(out.transpose(1, 2).reshape(b, t, -1))
        h = h + block.ffn(block.ffn_norm(h))
    return model.output(model.norm(h[:, -1]))
