"""How long a rank computes (`train.balance`): the time its work took, less the time it waited.

On a CPU that is the training thread's time on a core plus its time ready to run but not
given one (Linux schedstat: run time + run-queue delay). A wait for slower ranks in a collective,
or for data from a loader thread, sleeps and is not counted; a slice lost to a noisy neighbour
or a throttled cgroup is, which the thread's CPU time alone would miss. On a GPU it is the
device time between events recorded on the compute stream around each step's compute.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

SCHEDSTAT = Path("/proc/thread-self/schedstat")


def thread_busy_s() -> float:
    """The calling thread's run time plus run-queue delay, in seconds (its CPU time where the kernel has no schedstat)."""
    try:
        run_ns, wait_ns = SCHEDSTAT.read_text().split()[:2]
    except (OSError, ValueError):
        return time.thread_time()
    return (int(run_ns) + int(wait_ns)) / 1e9


class BusyClock:
    """Accumulates a rank's compute seconds over `begin()` / `end()` spans of the training thread."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._done = 0.0
        self._start: float | torch.cuda.Event | None = None
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # recorded on the device, not yet read

    def begin(self) -> None:
        """Start a span of compute."""
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = thread_busy_s()

    def end(self) -> None:
        """End the span `begin()` started."""
        start, self._start = self._start, None
        if isinstance(start, float):
            self._done += thread_busy_s() - start
        elif start is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self._spans.append((start, stop))  # read later: elapsed_time would wait for the device now
            # Fold the spans the device has finished (query() does not wait), so a run that never reads
            # `seconds` (train.balance off) keeps a few events, not two a step.
            while len(self._spans) > 1 and self._spans[0][1].query():
                first, last = self._spans.pop(0)
                self._done += first.elapsed_time(last) / 1e3

    @property
    def seconds(self) -> float:
        """Compute seconds of every ended span so far (on a GPU this waits for the last span's end)."""
        if self._spans:
            self._spans[-1][1].synchronize()
            self._done += sum(start.elapsed_time(stop) for start, stop in self._spans) / 1e3  # ms
            self._spans.clear()
        return self._done
