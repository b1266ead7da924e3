"""Another process's CPU share over a block of work, measured with psutil: `CpuShare` is its CPU seconds
per wall second (1.0: one core busy all the time), e.g. a loopback S3 endpoint serving a bench.
(A process's own peak memory growth is `cs3ray.data.peak_rss.PeakRss`.)
"""

from __future__ import annotations

import time

import psutil


class CpuShare:
    """CPU seconds (user + system, its threads included) of process `pid` per wall second since `start()`."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self._cpu0, self._t0 = 0.0, 0.0

    def _cpu(self) -> float:
        t = self._proc.cpu_times()
        return t.user + t.system

    def start(self) -> None:
        self._cpu0, self._t0 = self._cpu(), time.perf_counter()

    def fraction(self) -> float:
        """Since `start()`: CPU seconds over wall seconds."""
        wall = time.perf_counter() - self._t0
        return (self._cpu() - self._cpu0) / wall if wall > 0 else 0.0
