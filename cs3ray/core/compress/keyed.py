"""Per-key fp32 buffers a compressed sync keeps from step to step (error-feedback residuals, DGC velocities),
in loss-scale units, optionally transactional (fp16: a skipped step must leave them as they were)."""

from __future__ import annotations

from collections.abc import Hashable

import torch


class KeyedBuffers:
    """`committed` buffers by key; with `transactional`, a step writes into `pending` and `commit` swaps them in.

    Kept in the units of `scale` (the loss scale of the gradients) and rescaled when it changes: the
    scaler's factors are powers of two, so exactly. `used`: the keys a step has written since the last
    commit or rollback.
    """

    def __init__(self, transactional: bool = False) -> None:
        self.transactional = transactional
        self.scale = 1.0
        self.committed: dict[Hashable, torch.Tensor] = {}
        self.pending: dict[Hashable, torch.Tensor] = {}  # transactional: this step's buffers, or spares
        self.used: set[Hashable] = set()

    def set_scale(self, scale: float) -> None:
        """The loss scale of the next gradients: the buffers are brought to its units."""
        if scale != self.scale:
            for b in self.committed.values():
                b.mul_(scale / self.scale)
            self.scale = scale

    def commit(self) -> None:
        """The step is applied: its buffers become the committed ones, and those it did not use (a checkpoint's
        from another layout, FSDP modules that are gone) are dropped."""
        if not self.used:
            return  # an uncompressed step (warm-up, DDP's first sync) keeps what it has
        if self.transactional:
            for key in self.used:
                old = self.committed.get(key)
                self.committed[key] = self.pending.pop(key)
                if old is not None and old.numel() == self.committed[key].numel():
                    self.pending[key] = old  # the next step writes into it
        for key in [k for k in self.committed if k not in self.used]:
            del self.committed[key]
        for key in [k for k in self.pending if k not in self.committed]:
            del self.pending[key]
        self.used.clear()

    def rollback(self) -> None:
        """The step is skipped: the committed buffers stay as they were (transactional; otherwise the step has
        already updated them)."""
        self.used.clear()

    def nbytes(self) -> int:
        """Bytes the buffers hold (with their transactional spares)."""
        return sum(b.numel() * b.element_size() for d in (self.committed, self.pending) for b in d.values())

    def reset(self) -> None:
        """Forget every buffer."""
        self.committed.clear()
        self.pending.clear()
        self.used.clear()
        self.scale = 1.0
