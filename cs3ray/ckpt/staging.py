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


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped like `like`: pinned when `like` is on a GPU (its copy runs asynchronously),
    else page-aligned, so a chunk goes to the disk straight from it (direct_io, no bounce copy)."""
    if like.is_cuda and torch.cuda.is_available():
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
    raw = torch.from_numpy(direct_io.aligned_empty(like.numel() * like.element_size()))
    return (raw.view(like.dtype) if raw.numel() else torch.empty(0, dtype=like.dtype, device="cpu")).view(like.shape)


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
        """Leaf i's host buffer: kept while the leaf keeps its shape, dtype and (DTensor) layout."""
        buf = self._buffers[i]
        if (buf is not None and buf.shape == x.shape and buf.dtype == x.dtype and type(buf) is type(x)
                and getattr(buf, "_spec", None) == getattr(x, "_spec", None)):
            return buf
        host = _host_buffer(_local(x))
        if hasattr(x, "device_mesh"):
            # The same mesh and placements over a host shard (torch's own async staging does the same);
            # DTensor.from_local would move the shard back to the mesh's device.
            buf = x.detach().to("cpu") if _local(x).device.type != "cpu" else x.detach().clone()
            buf._local_tensor = host
        else:
            buf = host
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
                    copy_into(_local(buf), _local(src))  # device to pinned host, asynchronous
                    on_gpu = True
                else:
                    host.append((buf, src))
                x = buf
            out.append(x)
        self.digests = dict(self._run_host(host))
        if on_gpu:
            torch.cuda.synchronize()  # the buffers are complete before training may change the tensors
        return tree_unflatten(out, spec)

    def _run_host(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[tuple[int, int], str]]:
        """Copy and hash every host buffer, largest first, on the pool."""
        def one(job: tuple[torch.Tensor, torch.Tensor]) -> tuple[tuple[int, int], str]:
            buf, src = job
            copy_into(_local(buf), _local(src))
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
