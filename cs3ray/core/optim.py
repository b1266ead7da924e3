"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    zero_group: object | None = None) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; norms and other 1-D tensors get no weight decay.

    With `zero_group` (ZeRO-1), the optimizer state is partitioned over that group: each rank
    keeps AdamW state for its share of the parameters, steps it, and broadcasts the result.
    """
    # foreach kernels need one kind of tensor per group: plain tensors, or DTensors of one mesh
    # and layout (TP and FSDP2 shards), so parameters are grouped by that as well as by decay.
    buckets: dict[tuple, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        layout = (str(p.device_mesh.mesh_dim_names), str(tuple(p.device_mesh.shape)), str(tuple(p.placements))) \
            if hasattr(p, "device_mesh") else None
        buckets.setdefault((p.dim() >= 2, layout), []).append(p)
    groups = [{"params": ps, "weight_decay": weight_decay if decays else 0.0}
              for (decays, _), ps in sorted(buckets.items(), key=lambda kv: (not kv[0][0], str(kv[0][1])))]
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # parameters_as_bucket_view: broadcast updated parameters as a few flat buckets
        # instead of one collective per tensor.
        zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                       process_group=zero_group, parameters_as_bucket_view=True,
                                       lr=lr, betas=betas, foreach=True,
                                       weight_decay=groups[0]["weight_decay"])
        for g in groups[1:]:
            zero.add_param_group(g)
        return zero
    # foreach=True: one fused kernel launch per group instead of one per tensor.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step`: linear warmup, then cosine down to min_ratio."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
