"""An intra-node fp32 all-reduce through one shared-memory segment: no TCP for the data.

The segment holds one slot per local rank for its input and one slot for the result. Each rank
writes its input into its slot; after a barrier every rank sums its 1/L chunk of all slots in
rank order (so every rank gets bit-identical results, the same on every run) and writes it to
the result slot; after a second barrier each rank reads the whole result. The barriers run on a
gloo group of the local ranks: a few bytes each, the data never leaves shared memory.

The segment is a file under /dev/shm mapped by every local rank. It is unlinked as soon as all
ranks have mapped it, so nothing is left behind even if a process is killed; `close` (and an
exit hook) unlink it as well should a failure come between creating and mapping it, and a
segment whose creator was killed in that moment is unlinked by the next one created on the node.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import secrets
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist

PREFIX = "cs3ray-shm-"


def shm_dir() -> str:
    """Where segments live: /dev/shm (memory-backed) when the host has it."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def clean_stale() -> list[str]:
    """Unlink segments whose creator (the pid in the name) is gone: a kill between create and map."""
    removed = []
    for name in os.listdir(shm_dir()):
        pid = name[len(PREFIX):].split("-")[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(shm_dir(), name))
                removed.append(name)
            except OSError:
                pass
    return removed


def segment_token(group: Any = None) -> str:
    """A name shared by the ranks of `group` (the group's first rank draws it): unique per run and group."""
    token = [f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return token[0]


class ShmAllReduce:
    """fp32 sum (or mean) of equal-length flat tensors over the ranks of one node, in shared memory."""

    def __init__(self, group: Any = None, name: str | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.index = dist.get_rank(group)
        self.name = name or segment_token(group)
        self.capacity = 0  # values per slot
        self._generation = 0
        self._path: str | None = None  # set while this rank's created file may still exist
        self._map: mmap.mmap | None = None
        self._slots: torch.Tensor | None = None  # (size + 1, capacity) over the mapping
        self._exit_hook: Callable[[], None] | None = None

    @property
    def path(self) -> str:
        """The current segment's file (unlinked once every rank mapped it)."""
        return os.path.join(shm_dir(), f"{self.name}-{self._generation}")

    def barrier(self) -> None:
        """Wait for every local rank (synchronisation only: no data)."""
        dist.barrier(group=self.group)

    def _ensure(self, chunk: int) -> None:
        """Map a segment with room for `chunk` x size values per slot; every rank grows it at the same call."""
        need = chunk * self.size
        if need <= self.capacity:
            return
        self._unmap()
        self._generation += 1
        nbytes = (self.size + 1) * need * 4
        path = self.path
        if self.index == 0:
            if self._generation == 1:
                clean_stale()
            self._path = path
            # Only while the name exists: the hook would otherwise keep this object (and its mapping) alive.
            self._exit_hook = self._unlink
            atexit.register(self._exit_hook)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        self.barrier()  # created
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.barrier()  # every rank mapped it: the name is no longer needed
        if self.index == 0:
            self._unlink()
        self._slots = torch.frombuffer(self._map, dtype=torch.float32).view(self.size + 1, need)
        self.capacity = need

    def _unlink(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None

    def _unmap(self) -> None:
        self._slots = None  # the tensor must go before the mapping it exports
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view: the mapping goes with its last reference
                pass
            self._map = None
        self.capacity = 0

    def chunk(self, n: int) -> int:
        """Values of the chunk each local rank reduces, for tensors of n values."""
        return math.ceil(n / self.size)

    def reduce_own_chunk(self, flat: torch.Tensor, average: bool = False) -> torch.Tensor:
        """Write `flat`, then sum this rank's chunk of every rank's input in rank order.

        Returns a view of this rank's chunk of the result slot (length up to chunk(n)); the
        caller may change it in place before `gather`, which every local rank must then call.
        """
        n = flat.numel()
        c = self.chunk(n)
        self._ensure(c)
        assert self._slots is not None
        slots = self._slots
        slots[self.index, :n].copy_(flat.reshape(-1))
        self.barrier()  # every input is written
        lo, hi = min(n, self.index * c), min(n, (self.index + 1) * c)
        out = slots[self.size, lo:hi]
        self._sum(lo, hi, out, average)
        return out

    def _sum(self, lo: int, hi: int, dst: torch.Tensor, average: bool) -> None:
        """dst = the sum (or mean) of every local rank's input values [lo, hi), added in rank order."""
        slots = self._slots
        assert slots is not None
        # The first two in one pass (a copy and an add in place would read the chunk twice).
        if self.size == 1:
            dst.copy_(slots[0, lo:hi])
        else:
            torch.add(slots[0, lo:hi], slots[1, lo:hi], out=dst)
        for r in range(2, self.size):
            dst.add_(slots[r, lo:hi])
        if average:
            dst.div_(self.size)

    def reduce_regions(self, flat: torch.Tensor, regions: list[tuple[int, int]], out: torch.Tensor,
                       average: bool = False) -> None:
        """Write `flat`, then sum the (start, stop) `regions` of every local rank's input, in rank order, into
        `out` (the regions one after another). Every local rank calls it, each with its own regions."""
        n = flat.numel()
        self._ensure(self.chunk(n))
        assert self._slots is not None
        slots = self._slots
        slots[self.index, :n].copy_(flat.reshape(-1))
        self.barrier()  # every input is written
        pos = 0
        for lo, hi in regions:
            self._sum(lo, hi, out[pos:pos + hi - lo], average)
            pos += hi - lo
        self.barrier()  # every rank has read the inputs: the next call may overwrite them

    def gather(self, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """After every rank reduced its chunk: the whole result (n values), copied into `out` if given."""
        self.barrier()  # every chunk is reduced
        assert self._slots is not None
        result = self._slots[self.size, :n]
        if out is None:
            return result.clone()
        out.copy_(result.view_as(out))
        return out

    def __call__(self, flat: torch.Tensor, out: torch.Tensor | None = None, average: bool = False) -> torch.Tensor:
        """The sum (mean) of `flat` over the local ranks, in fp32."""
        self.reduce_own_chunk(flat, average)
        return self.gather(flat.numel(), out)

    def close(self) -> None:
        """Unmap the segment (and unlink it, if a failure left its name behind)."""
        self._unmap()
        self._unlink()
