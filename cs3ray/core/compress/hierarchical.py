"""Hierarchical sync: an fp32 shared-memory reduce inside each node, compression only between nodes.

With L ranks on each of N nodes (node-ordered ranks), local rank j of every node:
  1. writes its gradient into the node's shared-memory segment and sums chunk j (1/L of it)
     of every local rank's gradient in fp32 (`ShmAllReduce`): the node's mean of that chunk;
  2. runs the two-phase compressed all-reduce of that chunk with local rank j of the other
     nodes (a process group per local index), so all L local ranks use the network at once,
     each for 1/L of the gradient;
  3. writes the result back into the segment, from which every local rank reads the whole mean.
Only stage 2 crosses the network, so only its bytes count as sent; wire_ratio stays relative to
an fp32 ring all-reduce over all N x L ranks. Error feedback applies to stage 2 (the only lossy
one): each rank keeps residuals for its 1/L chunk. FSDP2's reduce-scatter goes the same way
without stage 3 (see `reduce_scatter`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import Topology, TopologyError
from .allreduce import CompressedAllReduce, ring_bytes
from .codec import Codec
from .shm import ShmAllReduce


def hierarchy(topology: Topology) -> tuple[list[list[int]], list[list[int]]]:
    """(ranks of each node, ranks of each local index across nodes); refuses nodes of unequal size."""
    nodes = list(dict.fromkeys(topology.node_ids))
    members = [[r for r, n in enumerate(topology.node_ids) if n == node] for node in nodes]
    sizes = sorted({len(m) for m in members})
    if len(sizes) > 1:
        raise TopologyError(f"compression.hierarchical needs the same number of workers on every node, got "
                            f"{[len(m) for m in members]} on {len(nodes)} nodes; place the workers evenly or "
                            f"set compression.hierarchical=false.")
    return members, [[m[j] for m in members] for j in range(sizes[0])]


def _own_group(lists: list[list[int]]) -> Any:
    """Create one process group per list (every rank creates all of them) and return this rank's."""
    group, _ = dist.new_subgroups_by_enumeration(lists, backend="gloo")
    return group


class HierarchicalAllReduce(CompressedAllReduce):
    """The mean over every rank of a flat fp32 tensor: shared memory inside a node, compressed across nodes."""

    def __init__(self, codec: Codec, topology: Topology, error_feedback: bool = True) -> None:
        members, crossing = hierarchy(topology)
        self.world, self.nodes, self.local_size = topology.world, len(members), len(crossing)
        # Every rank creates every group, in the same order, even those it does not use.
        cross = _own_group(crossing) if self.nodes > 1 else None
        local = _own_group(members) if self.local_size > 1 else None
        super().__init__(codec, cross, error_feedback)
        self.local = ShmAllReduce(local) if local is not None else None

    def __call__(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of `flat` over all ranks (stage-2 residuals kept under `key`); written into `out` if given."""
        n = flat.numel()
        sent = 0
        if self.local is None:  # one rank per node: the compressed all-reduce alone
            result, sent = self.all_reduce(key, flat, out)
            if out is None:
                result = result.clone()  # it may be a scratch buffer the next call overwrites
        else:
            chunk = self.local.reduce_own_chunk(flat, average=True)
            if self.nodes > 1 and chunk.numel():
                reduced, sent = self.all_reduce(key, chunk, out=chunk)
                if reduced.data_ptr() != chunk.data_ptr():
                    chunk.copy_(reduced)
            result = self.local.gather(n, out)
        self.stats.add(sent, ring_bytes(n, self.world))
        if out is None or result.data_ptr() == out.data_ptr():
            return out if out is not None else result
        out.copy_(result.view_as(out))
        return out

    def reduce_scatter(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor, average: bool = True) -> None:
        """FSDP2's reduce-scatter, hierarchically: `out` gets this rank's chunk of the sum (mean) of `flat`.

        `flat` holds one equal chunk per rank, in rank order. Local rank j sums, over shared memory,
        the chunks of rank j of every node, then reduce-scatters those N chunks, compressed, with
        local rank j of the other nodes: node k's share is rank k x L + j's chunk. No third stage:
        each rank ends with its own chunk, and its residual covers the chunks it sends to the other
        nodes, (N-1)/N of its 1/L of the unsharded gradient.
        """
        n, world = flat.numel(), self.world
        if n % world:
            raise ValueError(f"a reduce-scatter input of {n} values does not split into {world} equal chunks")
        c = n // world
        j = self.local.index if self.local is not None else 0
        regions = [((k * self.local_size + j) * c, (k * self.local_size + j + 1) * c) for k in range(self.nodes)]
        if self.local is None:
            mine = flat.reshape(-1)  # one rank per node: its chunks are the whole input, in node order
        else:
            mine = self._buffer("node_sum", (self.nodes * c,), torch.float32, flat.device)
            self.local.reduce_regions(flat, regions, mine, average=average)
        sent = 0
        if self.nodes > 1:
            total, size = self._reduce_own_chunk(key, mine, average)
            sent = (self.nodes - 1) * size
            out.copy_(total[:out.numel()].view_as(out))
        else:
            out.copy_(mine[:out.numel()].view_as(out))
        # The baseline stays an fp32 ring reduce-scatter over every rank.
        self.stats.add(sent, ring_bytes(n, world) / 2)

    def close(self) -> None:
        """Stop the communication thread, then unmap (and unlink) the node's segment."""
        super().close()
        if self.local is not None:
            self.local.close()
