"""Async checkpoints: the blocking device-to-host copy, and the low-priority thread that writes.

torchtitan-style: only the copy of the tensors blocks training. It lands in host buffers that
are kept from one save to the next (pinned when the tensors are on a GPU), so a save costs one
memcpy instead of fresh allocations and page faults. The hashing and writing that follow run in
a background thread at the lowest CPU priority, so on a machine whose cores training keeps busy
they take the cycles training leaves idle instead of slowing its steps.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .chunks import copy_into

log = logging.getLogger(__name__)


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
        else:
            buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda and torch.cuda.is_available())
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


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: nice is per thread); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere setpriority(PRIO_PROCESS, tid) would not mean this thread
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as exc:
        log.debug("could not lower the checkpoint thread's priority: %s", exc)
