"""Topology: which node each rank is on, and the (pipeline x data x tensor) device mesh built on it.

Ranks are ordered by node (Ray Train sorts its workers that way; we check it), so contiguous
rank blocks of size tp are tensor-parallel groups. Those groups all-reduce inside every block,
so they must never span the slow link between nodes: we refuse layouts where they would.
Pipeline stages are the outermost dimension (as in torchtitan and Megatron): a stage boundary
only sends one micro-batch's activations, so it is the dimension that may cross nodes, while a
data-parallel group (a whole stage's gradients) stays as close together as the layout allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cs3ray.errors import UserError


class TopologyError(UserError):
    """The requested parallel layout does not fit the workers' placement."""


@dataclass(frozen=True)
class Topology:
    """One rank's place: global rank, node, node-local peers and its data/tensor coordinates."""

    rank: int
    world: int
    tp: int
    node_ids: tuple[str, ...]  # node id of every rank, by rank
    pp: int = 1

    @property
    def node_id(self) -> str:
        return self.node_ids[self.rank]

    @property
    def node_rank(self) -> int:
        """Index of this rank's node in rank order."""
        return list(dict.fromkeys(self.node_ids)).index(self.node_id)

    @property
    def local_peers(self) -> list[int]:
        """Ranks on this rank's node (itself included)."""
        return [r for r, n in enumerate(self.node_ids) if n == self.node_id]

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self.rank // (self.dp * self.tp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def tp_group_ranks(self) -> list[int]:
        start = self.rank // self.tp * self.tp
        return list(range(start, start + self.tp))

    def check(self) -> None:
        """Refuse layouts where ranks are not node-ordered or a TP group would span nodes."""
        if self.world % self.tp:
            raise TopologyError(f"parallel.tp={self.tp} does not divide the {self.world} workers.")
        if self.world % (self.tp * self.pp):
            raise TopologyError(f"parallel.pp={self.pp} x parallel.tp={self.tp} does not divide the "
                                f"{self.world} workers.")
        seen: list[str] = []
        for n in self.node_ids:
            if seen and n != seen[-1] and n in seen:
                raise TopologyError("workers are not ordered by node; tensor-parallel groups could span nodes.")
            if not seen or n != seen[-1]:
                seen.append(n)
        for start in range(0, self.world, self.tp):
            if len({self.node_ids[r] for r in range(start, start + self.tp)}) > 1:
                raise TopologyError(f"parallel.tp={self.tp} would put ranks {start}..{start + self.tp - 1} of one "
                                    "tensor-parallel group on different nodes; use a tp that divides the "
                                    "workers per node.")

    def mesh(self, device_type: str) -> DeviceMesh | None:
        """The ('dp', 'tp') mesh, ('pp', 'dp', 'tp') with pipeline stages, or None without a process group."""
        if not dist.is_initialized():
            return None
        if self.pp > 1:
            return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


def discover(tp: int, node_id: str, pp: int = 1) -> Topology:
    """Exchange node ids over the process group and check the layout."""
    if dist.is_initialized():
        ids: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(ids, node_id)
        topo = Topology(dist.get_rank(), dist.get_world_size(), tp, tuple(ids), pp)
    else:
        topo = Topology(0, 1, tp, (node_id,), pp)
    topo.check()
    return topo
