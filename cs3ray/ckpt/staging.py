"""Async checkpoints: the blocking copy of the tensors into host buffers kept across saves.

torchtitan-style: only this copy blocks training. It lands in buffers that are kept from one
save to the next (pinned when the tensors are on a GPU, page-aligned on the host so the chunk
files are written from them with O_DIRECT), so a save costs one memcpy instead of fresh
allocations and page faults. The manager's background thread then writes them.

Tensors that live on the host are also hashed here (each chunk's XXH3-128 names it), by as many
threads as training uses, while each buffer is still in cache from its copy. On a GPU the host
cores are idle during a step, so there the background thread hashes; on a CPU host training
keeps every core busy, and background work competes with it for the whole step: each slice of
CPU the writer takes stalls both of training's threads (one waits at every parallel region's
barrier for the other). Hashing up front costs the same CPU once, while training waits anyway.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from cs3ray import direct_io

from .chunks import blob_key, copy_into, digest, tensor_blob


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


class Stager:
    """Copies a state dict's tensors into host buffers reused across saves, hashing the host ones.

    `digests` maps each staged host buffer's (address, size) to its chunk name (content hash); it is
    valid until the next `stage` call, which is when the buffers are overwritten.
    """

    def __init__(self, threads: int | None = None) -> None:
        self._spec: Any = None
        self._buffers: list[torch.Tensor | None] = []
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.digests: dict[tuple[int, int], str] = {}

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
        out, on_gpu, host = [], False, []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                buf = self._buffer(i, x)
                src = x.detach()
                if _local(src).is_cuda:
                    copy_into(buf, src)
                    on_gpu = True
                elif hasattr(src, "device_mesh"):
                    copy_into(buf, src)  # DTensor ops stay on this thread; the pool only hashes
                    host.append((buf, None))
                else:
                    host.append((buf, src))
                x = buf
            out.append(x)
        self.digests = dict(self._run_host(host))
        if on_gpu:
            torch.cuda.synchronize()  # the buffers are complete before training may change the tensors
        return tree_unflatten(out, spec)

    def _run_host(self, jobs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[tuple[tuple[int, int], str]]:
        """Copy (where a source is given) and hash every host buffer, largest first, on the pool."""
        def one(job: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[tuple[int, int], str]:
            buf, src = job
            if src is not None:
                copy_into(buf, src)
            blob = tensor_blob(_local(buf))
            return blob_key(blob), digest(blob)

        jobs = sorted(jobs, key=lambda j: -_local(j[0]).numel() * j[0].element_size())
        threads = self._threads or torch.get_num_threads()
        if threads <= 1 or len(jobs) <= 1:
            return [one(j) for j in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-stage")
        return list(self._pool.map(one, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
