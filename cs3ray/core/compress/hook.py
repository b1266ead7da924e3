"""The DDP comm hook that syncs each gradient bucket with the compressed all-reduce.

DDP calls it for a bucket as soon as that bucket's gradients are ready, so a bucket's
exchange runs while backward still computes later buckets. The first `warmup_steps` syncs
use torch's fp32 all-reduce, and so does the first sync of every process: DDP runs it in its
initial buckets and then rebuilds them in the order gradients became ready. Residuals are kept
by the rebuilt buckets, so nothing is compressed into buckets that are never seen again, and a
resumed process finds its saved residuals at its second sync (torch's PowerSGD hook, for the same
reason, compresses from the second iteration on).
"""

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ..mesh import Topology
from .allreduce import CompressedAllReduce, ring_bytes
from .codec import make_codec
from .dgc import DgcSettings, MomentumCorrection, clip_local, warmup_density
from .hierarchical import HierarchicalAllReduce


class CompressionHook:
    """State of the hook: the transport (residuals, byte counts) and the sync-step counter."""

    def __init__(self, codec: str, density: float = 0.1, error_feedback: bool = True, warmup_steps: int = 0,
                 group: Any = None, hierarchical: Topology | None = None, ddp_buckets: bool = False,
                 dgc: DgcSettings | None = None) -> None:
        # hierarchical: the topology whose nodes reduce over shared memory first (the whole world's group).
        self.reduce = (HierarchicalAllReduce(make_codec(codec, density), hierarchical, error_feedback)
                       if hierarchical is not None else CompressedAllReduce(make_codec(codec, density), group,
                                                                            error_feedback))
        self.group = group
        self.warmup_steps = warmup_steps
        self.steps = 0  # completed gradient syncs: optimizer steps whose gradients went through the hook
        self.initial_buckets = ddp_buckets  # DDP's first sync in this process: its buckets are rebuilt after it
        self.names: dict[int, str] = {}  # id(parameter) -> name, to key residuals by what a bucket holds
        # DGC (int4_sparse on the flat exchange): local clipping, momentum correction and masking, warm-up.
        self.dgc = dgc if codec == "int4_sparse" and hierarchical is None else None
        self.density = density
        if self.dgc is not None and self.dgc.momentum > 0:
            self.reduce.momentum = MomentumCorrection(self.dgc.momentum, self.dgc.factor_masking)

    @property
    def momentum(self) -> MomentumCorrection | None:
        """DGC's velocities (None without momentum correction)."""
        return getattr(self.reduce, "momentum", None)

    def set_transactional(self, transactional: bool) -> None:
        """fp16 (steps may be skipped): residual and velocity updates are kept apart until the step's fate."""
        self.reduce.feedback.transactional = transactional
        if self.momentum is not None:
            self.momentum.transactional = transactional

    def prepare(self, key: Hashable, flat: torch.Tensor, world: int) -> None:
        """DGC on this rank's gradient before it is exchanged, in place: clip it by its own norm against
        clip_norm / sqrt(world), then replace it by its velocity (momentum correction)."""
        if self.dgc is None:
            return
        clip_local(flat, self.dgc.clip_norm, world, self.reduce.feedback.scale)
        if self.momentum is not None:
            self.momentum.accumulate(key, flat)

    @property
    def compressing(self) -> bool:
        """Whether the current sync is compressed (warm-up over, and DDP's buckets rebuilt)."""
        return self.steps >= self.warmup_steps and not self.initial_buckets

    def end_sync(self) -> None:
        """An optimizer step's gradients are synced (FSDP: its micro-batches' reduce-scatters are done)."""
        self.steps += 1

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals (and DGC velocities) this rank keeps."""
        return self.reduce.feedback.nbytes() + (self.momentum.nbytes() if self.momentum is not None else 0)

    def begin_step(self, loss_scale: float) -> None:
        """Before a step's backward passes: the loss scale its gradients carry (fp16), which the residuals and
        velocities follow, and DGC's warm-up share for int4_sparse."""
        self.reduce.feedback.set_scale(loss_scale)
        if self.momentum is not None:
            self.momentum.set_scale(loss_scale)
        if self.dgc is not None and self.dgc.warmup_steps:
            share = warmup_density(max(0, self.steps - self.warmup_steps), self.dgc, self.density)
            if share != self.reduce.codec.density:
                self.reduce.codec = dataclasses.replace(self.reduce.codec, density=share)

    def end_step(self, applied: bool) -> None:
        """After the step's syncs, once every rank knows whether it is applied: residuals are committed or,
        for a skipped step, left as they were (fp16's transactional residuals). Called on the main thread
        after backward, when every exchange has finished."""
        for store in (self.reduce.feedback, self.momentum):
            if store is not None:
                store.commit() if applied else store.rollback()

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (they belong to its own buckets and chunks), for its own checkpoint file,
        and the loss scale they are in units of."""
        feedback = self.reduce.feedback
        state = {"codec": self.reduce.codec.name, "residuals": dict(feedback.residuals), "scale": feedback.scale}
        if self.momentum is not None:  # DGC's velocities, in the same loss-scale units as the residuals
            state["velocities"] = dict(self.momentum.velocities)
        return state

    def load_state_dict(self, state: dict[str, Any], steps: int) -> bool:
        """Restore residuals saved by this rank with the same codec; True if they were restored."""
        self.steps = steps
        self.reduce.feedback.reset()
        if self.momentum is not None:
            self.momentum.reset()
        if state.get("codec") != self.reduce.codec.name:
            return False
        self.reduce.feedback.residuals.update({k: v.clone() for k, v in state["residuals"].items()})
        self.reduce.feedback.scale = state.get("scale", 1.0)  # brought to the run's scale at its next step
        if self.momentum is not None:
            self.momentum.velocities.update({k: v.clone() for k, v in state.get("velocities", {}).items()})
            self.momentum.scale = self.reduce.feedback.scale
        return True

    def stats(self) -> dict[str, float | int | None]:
        """Bytes sent by this rank so far, the fp32 ring baseline, their ratio and the syncs counted."""
        s = self.reduce.stats
        return {"bytes_sent": s.bytes_sent, "fp32_ring_bytes": s.fp32_ring_bytes, "wire_ratio": s.wire_ratio,
                "syncs": self.steps}


# No postponed annotations in this module: DDP checks the hook's annotations against the real types.
def compress_hook(state: CompressionHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean gradient, compressed once warm-up is over."""
    buffer = bucket.buffer()
    last = bucket.is_last()
    world = dist.get_world_size(state.group)
    if not state.compressing:
        fp32 = ring_bytes(buffer.numel(), world)
        state.reduce.stats.add(round(fp32 * buffer.element_size() / 4), fp32)
        fut = allreduce_hook(state.group, bucket)
    else:
        # Keyed by the bucket's first and last parameter and its size, not its index: the same
        # buckets get the same keys in every process that reaches DDP's rebuilt layout.
        params = bucket.parameters()
        key = (state.names.get(id(params[0]), ""), state.names.get(id(params[-1]), ""), buffer.numel())
        state.prepare(key, buffer, world)
        fut = state.reduce.start(key, buffer, out=buffer)
    if last:
        state.steps += 1
        state.initial_buckets = False
    return fut


def register_compression(model: torch.nn.Module, codec: str, density: float = 0.1, error_feedback: bool = True,
                         warmup_steps: int = 0, group: Any = None, hierarchical: Topology | None = None,
                         dgc: DgcSettings | None = None) -> CompressionHook:
    """Install the compressed sync on a DDP model; returns the hook's state (stats, residuals).

    With `hierarchical` (the ranks' topology) each node reduces over shared memory first and
    only the cross-node stage is compressed.
    """
    state = CompressionHook(codec, density, error_feedback, warmup_steps, group, hierarchical, ddp_buckets=True, dgc=dgc)
    state.names = {id(p): name for name, p in model.named_parameters()}
    model.register_comm_hook(state, compress_hook)
    return state
