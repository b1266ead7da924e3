"""Gradient norm and clipping that work for plain, DDP, FSDP2 and tensor-parallel gradients.

torch's clip_grad_norm_ refuses a mix of DTensors on different meshes and plain tensors
(TP blocks next to replicated embeddings). Here each gradient adds its local sum of squares,
and only the shards of sharded DTensors are summed over the mesh dimensions they are split on.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from .fake import host_float


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients, identical on every rank."""
    plain: list[torch.Tensor] = []
    sharded: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            key = (g.device_mesh, tuple(g.placements))
            sharded.setdefault(key, []).append(g.to_local().float().pow(2).sum())
        else:
            plain.append(g.float().pow(2).sum())
    device = next((t.device for t in plain), None) or next((v[0].device for v in sharded.values()), torch.device("cpu"))
    total = torch.stack(plain).sum() if plain else torch.zeros((), device=device)
    for (mesh, placements), parts in sharded.items():
        s = torch.stack(parts).sum()
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(s, group=mesh.get_group(dim))
        total = total + s
    return total.sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, counted: list[torch.Tensor] | None = None,
                   group: Any = None) -> float:
    """Scale gradients so their global norm is at most max_norm; returns the norm before clipping.

    `counted`: the parameters whose gradients make up the norm (default: all); `group`: ranks holding other
    parameters of the model (pipeline stages), whose sums of squares are added to this rank's.
    """
    norm = grad_norm(params if counted is None else counted)
    if group is not None:
        squares = norm.pow(2)
        dist.all_reduce(squares, group=group)
        norm = squares.sqrt()
    value = host_float(norm)
    scale = max_norm / (value + 1e-6)
    if scale < 1.0:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, scale)
    return value
