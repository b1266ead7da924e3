"""Parallelism applied to an unmodified model from the outside (torchtitan's apply_* style).

Order matters and is fixed: tensor parallel -> activation checkpointing -> compile -> data
parallel wrapping last, because DDP/FSDP must see the final module structure.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: int = 25) -> nn.Module:
    """Replicate the model; gradients are all-reduced in buckets overlapped with backward."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view avoids a copy of every gradient into the comm buckets.
    return DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper."""
    return model.module if isinstance(model, DDP) else model
