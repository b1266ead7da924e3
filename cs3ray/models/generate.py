"""Autoregressive generation with a KV cache: greedy or temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tokenizer_load import Tokenizer
from .transformer import KVCache, Transformer


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row of `logits` (batch, vocab); temperature 0 means greedy."""
    logits = logits.float()
    if params.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate_ids(model: Transformer, prompt: list[int], params: SamplingParams,
                 stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Generated token ids after `prompt` (prompt excluded), stopping at max_tokens or a stop id."""
    args = model.args
    budget = min(params.max_tokens, args.max_seq_len - len(prompt))
    if budget <= 0:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the {args.max_seq_len}-token context")
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cache = KVCache(args, 1, len(prompt) + budget, dtype, device)
    gen = torch.Generator(device=device).manual_seed(params.seed) if params.seed is not None else None
    logits = model(torch.tensor([prompt], device=device), cache)[:, -1]
    out: list[int] = []
    for _ in range(budget):
        nxt = sample_next(logits, params, gen)
        tok = int(nxt.item())
        if tok in stop_ids:
            break
        out.append(tok)
        if len(out) == budget:
            break
        logits = model(nxt.view(1, 1), cache)[:, -1]
    return out


def generate_text(model: Transformer, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> str:
    """Text continuation of `prompt`."""
    # Training documents are separated by EOS, so EOS first means "a document starts here";
    # it also gives an empty prompt something to condition on.
    ids = generate_ids(model, [tokenizer.eos_id] + tokenizer.encode(prompt), params, stop_ids=(tokenizer.eos_id,))
    return tokenizer.decode(ids)
