"""Deep Gradient Compression's remedies for sparse updates (Lin et al., 2018), for int4_sparse.

A rank's gradient for a synced tensor (a DDP bucket, an FSDP2 module's flat gradient) is first
clipped by its own norm against `clip_norm` / sqrt(N) (local gradient clipping: the N ranks'
sum then stays within clip_norm), then folded into a local velocity u = m u + g (momentum
correction), and u, not g, enters the compressed exchange, whose error feedback is DGC's
accumulator v += u with the top-k of v sent. Where a value of v was sent, u is zeroed (momentum
factor masking: a delayed coordinate's old momentum does not push it again). The accumulator
keeps the 4-bit quantization error of a sent value, not zero: error feedback delays it instead
of dropping it. A rank's own chunk of the two-phase exchange is always sent in full, so its
velocity is zeroed every step. Warm-up: the first `warmup_steps` compressed steps send a share
that falls exponentially from `warmup_density` to `density`.

Velocities follow the error-feedback residuals' rules: kept per key in loss-scale units, written
beside the committed ones under fp16 (a skipped step leaves them as they were), pruned when a
compressed step did not use them, and saved with the residuals in the rank's own file.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..fake import host_float
from .keyed import KeyedBuffers


@dataclass(frozen=True)
class DgcSettings:
    """What int4_sparse applies of DGC (see `compression.dgc`)."""

    momentum: float = 0.0  # AdamW's beta1 is the momentum (see compression.dgc.momentum)
    clip_norm: float = 0.0  # 0: no local clipping
    factor_masking: bool = True
    warmup_steps: int = 0
    warmup_density: float = 1.0


def warmup_density(step: int, settings: DgcSettings, density: float) -> float:
    """The share int4_sparse sends at compressed step `step` (0 = the first): exponential from
    `warmup_density` to `density` over `warmup_steps` steps, then `density`."""
    if step >= settings.warmup_steps or settings.warmup_density <= density:
        return density
    return settings.warmup_density * (density / settings.warmup_density) ** (step / settings.warmup_steps)


def clip_local(flat: torch.Tensor, clip_norm: float, world: int, scale: float = 1.0) -> float:
    """Scale `flat` in place so its L2 norm is at most clip_norm / sqrt(world) (in units of the loss
    `scale` it carries); returns the factor applied (1.0 when within the bound, or not finite)."""
    if clip_norm <= 0:
        return 1.0
    bound = scale * clip_norm / math.sqrt(world)
    # nan for a rehearsal's fake tensors: no clipping there, as for an overflowed fp16 step (skipped anyway).
    norm = host_float(torch.linalg.vector_norm(flat.detach().float()))
    if not math.isfinite(norm) or norm <= bound:
        return 1.0
    factor = bound / norm
    flat.mul_(factor)
    return factor


class MomentumCorrection(KeyedBuffers):
    """Local velocities keyed like the error-feedback residuals: u = m u + g, masked where sent.

    Transactional (fp16): a step's velocities are written beside the committed ones and become them
    only at `commit`; `rollback` leaves the committed ones as they were.
    """

    def __init__(self, momentum: float, masking: bool = True, transactional: bool = False) -> None:
        super().__init__(transactional)
        self.momentum, self.masking = momentum, masking

    @property
    def velocities(self) -> dict[Hashable, torch.Tensor]:
        return self.committed

    @velocities.setter
    def velocities(self, value: dict[Hashable, torch.Tensor]) -> None:
        self.committed = value

    def _current(self, key: Hashable) -> torch.Tensor | None:
        """This step's velocity of `key` once `accumulate` has run (pending under fp16)."""
        return (self.pending if self.transactional else self.velocities).get(key) if key in self.used else None

    def accumulate(self, key: Hashable, flat: torch.Tensor) -> None:
        """flat <- u = m u + flat, in place, and u is kept as `key`'s velocity for this step.

        A key synced again in the same step (FSDP2's micro-batches) adds its gradient to this step's
        velocity and sends that gradient alone: the step's inputs then add up to m u + g1 + g2.
        """
        x = flat.detach().reshape(-1)
        current = self._current(key)
        if current is not None and current.numel() == x.numel():
            current.add_(x)
            return
        old = self.velocities.get(key)
        if old is not None and old.numel() != x.numel():  # a checkpoint's from another layout starts afresh
            old = None
        if self.transactional:
            new = self.pending.get(key)
            if new is None or new.numel() != x.numel():
                new = self.pending[key] = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
        else:
            new = old if old is not None else torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            self.velocities[key] = new
        if old is None:
            new.copy_(x)
        elif new is old:
            new.mul_(self.momentum).add_(x)
        else:
            torch.add(x, old, alpha=self.momentum, out=new)
        self.used.add(key)
        x.copy_(new)

    def mask(self, key: Hashable, offset: int, sent: torch.Tensor) -> None:
        """Momentum factor masking: zero the velocity where `sent` (values from `offset`) is not zero."""
        u = self._current(key)
        if u is None or not self.masking:
            return
        piece = u[offset:offset + sent.numel()]  # a padded last chunk reaches past the tensor
        piece.masked_fill_(sent.reshape(-1)[:piece.numel()] != 0, 0.0)

    def mask_all(self, key: Hashable, offset: int, length: int) -> None:
        """A span sent in full (a rank's own chunk): its velocity is zeroed."""
        u = self._current(key)
        if u is not None and self.masking:
            u[offset:offset + length].zero_()
