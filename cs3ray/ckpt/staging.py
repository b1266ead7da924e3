"""Async checkpoints: the blocking copy of the tensors into host buffers kept across saves.

torchtitan-style: only this copy blocks training. It lands in buffers that are kept from one
save to the next (pinned when the tensors are on a GPU, page-aligned on the host so the chunk
files are written from them with O_DIRECT), so a save costs one memcpy instead of fresh
allocations and page faults. The manager's background thread then hashes and writes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from cs3ray import direct_io

from .chunks import copy_into


class Stager:
    """Copies a state dict's tensors into host buffers reused across saves."""

    def __init__(self) -> None:
        self._spec: Any = None
        self._buffers: list[torch.Tensor | None] = []

    def _buffer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        buf = self._buffers[i]
        if buf is not None and buf.shape == x.shape and buf.dtype == x.dtype and type(buf) is type(x):
            return buf
        if hasattr(x, "device_mesh"):  # a DTensor: a buffer with the same mesh and placements
            buf = x.detach().clone()
        elif x.is_cuda and torch.cuda.is_available():
            buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        else:  # page-aligned, so a chunk goes to the disk straight from here (direct_io, no bounce copy)
            raw = torch.from_numpy(direct_io.aligned_empty(x.numel() * x.element_size()))
            buf = (raw.view(x.dtype) if raw.numel() else torch.empty(0, dtype=x.dtype)).view(x.shape)
        self._buffers[i] = buf
        return buf

    def stage(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this stager's buffers (valid until the next call)."""
        leaves, spec = tree_flatten(state)
        if spec != self._spec:
            self._spec, self._buffers = spec, [None] * len(leaves)
        out, on_gpu = [], False
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                buf = self._buffer(i, x)
                copy_into(buf, x.detach())
                on_gpu |= x.is_cuda
                x = buf
            out.append(x)
        if on_gpu:
            torch.cuda.synchronize()  # the buffers are complete before training may change the tensors
        return tree_unflatten(out, spec)
