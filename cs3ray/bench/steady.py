"""Where a run's steps reach their steady state, measured from its step times rather than assumed.

A fresh process's first steps are slower (allocation, the kernels' primitive caches, the first
optimizer step), by how much and for how long differs between hosts. So every mode of a bench
records each step's seconds, and its rate starts at the first step from which the step time no
longer drifts: the median of the next WINDOW steps within DRIFT of the median of the WINDOW after
them. Every mode runs the same steps and is judged by the same rule; what came before the
steady state is the warm-up, what follows is measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

WINDOW = 3
DRIFT = 0.05


@dataclass(frozen=True)
class Steady:
    """A run's measured part: the first measured step, its steps, their seconds, and whether the drift
    criterion held (else the last `least` steps are measured and `steady` is False)."""

    start: int
    steps: int
    seconds: float
    steady: bool

    def rate(self, units_per_step: float) -> float:
        return units_per_step * self.steps / self.seconds if self.seconds > 0 else 0.0


def drift(times: list[float], i: int, window: int = WINDOW) -> float:
    """|median(times[i : i+w]) / median(times[i+w : i+2w]) - 1|: how far a step time still moves at step i."""
    a = statistics.median(times[i:i + window])
    b = statistics.median(times[i + window:i + 2 * window])
    return abs(a / b - 1.0) if b > 0 else float("inf")


def steady_part(times: list[float], least: int, first: int = 0, window: int = WINDOW, bound: float = DRIFT) -> Steady:
    """The steps from the first index >= `first` whose drift is within `bound`, keeping at least `least` steps.

    `first` skips steps known to differ (a step measured for peak memory). Where no index qualifies,
    the last `least` steps are measured and the result says it was not steady."""
    if least < 1 or len(times) - first < least:
        raise ValueError(f"{len(times)} step times hold fewer than {least} steps after step {first}")
    last = len(times) - least  # the latest start that still leaves `least` steps
    for i in range(first, last + 1):
        if i + 2 * window > len(times):  # no later window to compare with
            break
        if drift(times, i, window) <= bound:
            return Steady(i, len(times) - i, sum(times[i:]), True)
    return Steady(last, least, sum(times[last:]), False)
