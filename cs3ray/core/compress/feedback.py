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
from .keyed import KeyedBuffers


class ErrorFeedback(KeyedBuffers):
    """Residuals keyed by a caller's name for each tensor (a DDP bucket, a chunk a rank reduces).

    Residuals are kept in the units of `scale`, the loss scale of the gradients being encoded, and
    rescaled when it changes (`set_scale`; the scaler's factors are powers of two, so exactly): an
    fp16 run's residuals mean the same gradient before and after its scale halves or doubles.
    Transactional (fp16, where a step can be skipped): a step's encodes write new residuals beside
    the committed ones, and the step's fate decides (`commit`, `rollback`), so a skipped step leaves
    every residual exactly as it was; this keeps a second buffer per residual.
    """

    def __init__(self, enabled: bool = True, transactional: bool = False) -> None:
        super().__init__(transactional)
        self.enabled = enabled

    @property
    def residuals(self) -> dict[Hashable, torch.Tensor]:
        return self.committed

    @residuals.setter
    def residuals(self, value: dict[Hashable, torch.Tensor]) -> None:
        self.committed = value

    def _target(self, key: Hashable, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the buffer this step's residual of `key` is written to, the residual it starts from: None if
        it is that buffer already, or zero)."""
        res = self.residuals.get(key)
        if res is not None and res.numel() != length:  # a checkpoint's from another layout starts afresh
            res = None
        if not self.transactional:
            if res is None:
                res = self.residuals[key] = torch.zeros(length, dtype=torch.float32, device=like.device)
            return res, None
        nxt = self.pending.get(key)
        if nxt is None or nxt.numel() != length:
            nxt = self.pending[key] = torch.empty(length, dtype=torch.float32, device=like.device)
        # A key encoded again in the same step (FSDP's micro-batches) continues from its pending residual.
        return nxt, None if key in self.used else res

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
        length = x.numel() if length is None else length
        fresh = self.transactional and key not in self.used
        target, start = self._target(key, length, x)
        self.used.add(key)
        piece = target[offset:offset + x.numel()]
        # In place: the buffer holds the compensated input, then what was not sent (large fresh
        # allocations cost more than the arithmetic on a CPU).
        if not fresh:
            piece.add_(x)
        elif start is None:
            piece.copy_(x)
        else:
            torch.add(start[offset:offset + x.numel()], x, out=piece)
        payload, sent = codec.encode_sent(piece, out, sent)
        piece.sub_(sent)
        # An overflowed step must not poison the following ones (a transactional step is rolled back instead).
        if not self.transactional and not host_bool(torch.isfinite(piece.sum()), fake=True):
            piece.zero_()
        return payload, sent
