"""When a step ends in a snapshot: checkpoint.every steps, checkpoint.every_minutes, a stop, the end, a preemption.

A time-triggered snapshot is a collective (every rank saves its shards at the same step), but clocks
and step times differ between ranks, so only the reporting rank (rank 0; with fault-tolerant replicas the
first one alive) reads its clock: `SnapshotClock.due` is its vote, carried in the all-reduce of loss and
stop flag that every step already makes. Every rank reads the same sum, so all agree on the step, and a
run of 2,048 ranks pays no collective of its own for it.
"""

from __future__ import annotations

import time
from typing import Callable

STEPS, MINUTES, PREEMPTION, STOP, END = "steps", "minutes", "preemption", "stop", "end"


class SnapshotClock:
    """Seconds since this process's last snapshot (or its start) against checkpoint.every_minutes."""

    def __init__(self, every_minutes: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_minutes * 60 if every_minutes else None
        self._clock = clock
        self._since = clock()

    def due(self) -> bool:
        return self.every_s is not None and self._clock() - self._since >= self.every_s

    def taken(self) -> None:
        """A snapshot (of any trigger) has just blocked training: count from its end, so that every_minutes of
        training come between two, even where a save takes longer than the interval."""
        self._since = self._clock()


def trigger(step: int, every: int, last_step: int, timed: bool, stop: bool, preempted: bool) -> str | None:
    """Why the step just done (`step`) ends in a snapshot, or None: the regular schedule named first."""
    if step % every == 0:
        return STEPS
    if timed:
        return MINUTES
    if preempted:
        return PREEMPTION
    if stop:
        return STOP
    return END if step == last_step else None
