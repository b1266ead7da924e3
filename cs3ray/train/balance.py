"""Dynamic load balancing (`train.balance`): each rank's share of the global batch, re-split by speed.

The rule is LB-BSP's (Chen et al., 2019): give every rank a share of the fixed global batch in
proportion to how many samples per second it computes, so all reach the synchronisation at once.
Shares change only when the ranks are persistently uneven (`patience` windows in a row predict a
step at least `threshold` shorter), so noise does not move samples back and forth. What the step
contains never changes: the micro-batch's samples in the global order, split at other points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def split_shares(total: int, rates: list[float], minimum: int = 1) -> list[int]:
    """`total` rows split in proportion to `rates` (largest remainders), each rank at least `minimum`."""
    n = len(rates)
    if n * minimum > total:
        raise ValueError(f"{total} rows cannot give {n} ranks {minimum} each")
    weights = [max(r, 0.0) for r in rates]
    if not sum(weights):
        weights = [1.0] * n
    exact = [total * w / sum(weights) for w in weights]
    shares = [math.floor(x) for x in exact]
    # Hand out what rounding down left, largest remainder first (lower rank on ties: deterministic).
    for i in sorted(range(n), key=lambda i: (-(exact[i] - shares[i]), i))[:total - sum(shares)]:
        shares[i] += 1
    # A rank too slow for `minimum` rows still gets them, from the largest shares.
    for i in range(n):
        while shares[i] < minimum:
            shares[max(range(n), key=lambda j: shares[j])] -= 1
            shares[i] += 1
    return shares


def step_time(shares: list[int], rates: list[float]) -> float:
    """The synchronised step's length: the slowest rank's rows / its rate."""
    return max(n / r for n, r in zip(shares, rates, strict=True) if n) if any(shares) else 0.0


@dataclass
class Balancer:
    """Decides, window after window of measured per-rank compute, when to re-split and how."""

    shares: list[int]
    threshold: float = 0.05
    patience: int = 2
    _votes: int = field(default=0, init=False)

    def observe(self, seconds: list[float], rows: list[int]) -> list[int] | None:
        """Per-rank compute seconds and rows of the last window; the new shares when they change, else None."""
        if any(s <= 0 for s in seconds):
            return None
        rates = [n / s for n, s in zip(rows, seconds, strict=True)]
        proposal = split_shares(sum(self.shares), rates)
        now, then = step_time(self.shares, rates), step_time(proposal, rates)
        self._votes = self._votes + 1 if proposal != self.shares and then < now * (1 - self.threshold) else 0
        if self._votes < self.patience:
            return None
        self._votes, self.shares = 0, proposal
        return proposal
