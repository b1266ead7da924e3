"""Async checkpoints: the blocking device-to-host copy, and the low-priority thread that writes.

torchtitan-style: only the copy of the tensors blocks training. It lands in host buffers that
are kept from one save to the next (pinned when the tensors are on a GPU), so a save costs one
memcpy instead of fresh allocations and page faults. The hashing and writing that follow run in
a background thread at the lowest CPU priority, so on a machine whose cores training keeps busy
they take the cycles training leaves idle instead of slowing its steps; when training has to
wait for a write (the next save comes first), the thread gets training's priority back.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

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


LOW_PRIORITY = 19  # nice value of the writer thread while training runs


def _nice(tid: int, value: int | None = None) -> int | None:
    """Get (or set) one thread's nice value; None where that is not possible.

    Linux keeps nice per thread; elsewhere setpriority(PRIO_PROCESS, tid) would not mean this
    thread, so nothing is changed there.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        if value is not None:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as exc:
        log.debug("nice of thread %d: %s", tid, exc)
        return None


def _may_raise_back(base: int) -> bool:
    """Whether this process may lift a thread from LOW_PRIORITY back to nice `base`."""
    import resource

    return os.geteuid() == 0 or 20 - resource.getrlimit(resource.RLIMIT_NICE)[0] <= base


class Writer:
    """The one background thread that writes async checkpoints.

    It runs at the lowest priority while training runs, and at the caller's priority while the
    caller waits for it (`urgent`), so a write that training must wait for is not starved by
    other processes. Where the process may not raise a priority again, it keeps the caller's.
    """

    def __init__(self) -> None:
        self._tid: int | None = None
        base = _nice(threading.get_native_id())
        self._low = base is not None and _may_raise_back(base)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt", initializer=self._start)

    def _start(self) -> None:
        self._tid = threading.get_native_id()
        if self._low:
            _nice(self._tid, LOW_PRIORITY)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    @contextmanager
    def urgent(self) -> Iterator[None]:
        """While the block runs, the writer runs at the calling thread's priority."""
        tid = self._tid
        if not self._low or tid is None:
            yield
            return
        _nice(tid, _nice(threading.get_native_id()))
        try:
            yield
        finally:
            _nice(tid, LOW_PRIORITY)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
