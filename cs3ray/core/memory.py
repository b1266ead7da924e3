"""What each rank owns in memory: exact tensor bytes of parameters, gradients, optimizer state."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2 / TP): only the local shard lives in this rank's memory.
    return t.to_local() if hasattr(t, "to_local") else t


def payload_bytes(x: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple, as handed to a collective."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(payload_bytes(v) for v in x)
    return 0


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct local tensors (shared storage counted once)."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        loc = _local(t)
        # The storage's identity, not data_ptr(): fake tensors (a rehearsal) have no data to point at.
        key = (loc.untyped_storage()._cdata, loc.storage_offset(), loc.numel())
        if key in seen or not loc.numel():
            continue
        seen.add(key)
        total += loc.numel() * loc.element_size()
    return total


def owned_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state held by this rank (sharded tensors: the local shard)."""
    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt = getattr(optimizer, "optim", optimizer)
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"param_bytes": tensor_bytes(params), "grad_bytes": tensor_bytes(grads),
            "optim_bytes": tensor_bytes(states)}


def peak_step_memory(run_step: Callable[[], Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                     device: torch.device) -> tuple[Any, int | None]:
    """Run one step and return (its result, peak bytes of tensors allocated during it).

    CUDA has allocator counters; on CPU torch's MemTracker counts every tensor allocation
    (a dispatch mode, so it is used for one step only).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        out = run_step()
        return out, int(torch.cuda.max_memory_allocated(device))
    if not all(p.requires_grad for p in model.parameters()):
        return run_step(), None  # MemTracker hooks every parameter's gradient: frozen ones refuse hooks
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    except (ImportError, NotImplementedError, RuntimeError, AssertionError):
        return run_step(), None  # no tracker for this setup: run the step untracked
    with tracker:
        out = run_step()
    peak = tracker.get_tracker_snapshot("peak")
    return out, int(sum(d.get("Total", 0) for d in peak.values()))
