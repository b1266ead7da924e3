"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW over trainable parameters; norms and other 1-D tensors get no weight decay."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=True: one fused kernel launch per group instead of one per tensor.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, foreach=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step`: linear warmup, then cosine down to min_ratio."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
