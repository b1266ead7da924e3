"""Error feedback: what a codec dropped this step is added to the next step's input.

With it, compression delays part of a gradient instead of losing it, which is what keeps
convergence at int8 and 4-bit sparse (1-bit Adam, EF-SGD). transmitted + residual equals the
compensated input exactly in fp32: for round-to-nearest codecs the decoded value is within a
factor of 2 of the input (or zero), so the subtraction is exact (Sterbenz).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..fake import host_bool
from .codec import Codec


class ErrorFeedback:
    """Residuals keyed by a caller's name for each tensor (a DDP bucket, a chunk a rank reduces)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.used: set[Hashable] = set()  # keys encoded since the last prune

    def encode(self, key: Hashable, codec: Codec, x: torch.Tensor, out: torch.Tensor | None = None,
               offset: int = 0, length: int | None = None,
               sent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, transmitted values) of x plus the residual kept under `key`; updates the residual.

        The payload is written into `out` and the transmitted values (what decoding the payload gives,
        bit for bit) into `sent` if given, else into a buffer the thread's next encode reuses. x may be
        the piece from `offset` of a tensor of `length` values (one residual covers the whole; a
        transport encodes the pieces one by one).
        """
        x = x.detach().reshape(-1)
        if not self.enabled or codec.name == "none":  # an exact codec leaves nothing behind
            return codec.encode_sent(x, out, sent)
        self.used.add(key)
        length = x.numel() if length is None else length
        res = self.residuals.get(key)
        # A residual of another length under this key (a checkpoint's from another layout) starts afresh.
        if res is None or res.numel() != length:
            res = self.residuals[key] = torch.zeros(length, dtype=torch.float32, device=x.device)
        res = res[offset:offset + x.numel()]
        # In place: the residual's buffer holds the compensated input, then what was not sent
        # (large fresh allocations cost more than the arithmetic on a CPU).
        res.add_(x)
        payload, sent = codec.encode_sent(res, out, sent)
        res.sub_(sent)
        # An overflowed (skipped) step must not poison the following ones.
        if not host_bool(torch.isfinite(res.sum()), fake=True):
            res.zero_()
        return payload, sent

    def nbytes(self) -> int:
        """Bytes the residuals hold."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def prune(self) -> None:
        """Drop residuals no encode used since the last prune: those of keys this run no longer syncs
        (a checkpoint's from another bucket layout) would only cost memory and checkpoint bytes."""
        for key in [k for k in self.residuals if k not in self.used]:
            del self.residuals[key]
        self.used.clear()

    def reset(self) -> None:
        """Forget every residual."""
        self.residuals.clear()
        self.used.clear()
