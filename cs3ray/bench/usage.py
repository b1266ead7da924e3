"""A process's CPU share and its peak memory growth over a block of work, measured with psutil.

`PeakRss` samples this process's resident set from a thread (a driver that gathers a corpus shows
it as growth; one that only plans and waits stays flat); `CpuShare` is another process's CPU seconds
per wall second (1.0: one core busy all the time), e.g. a loopback S3 endpoint serving a bench.
"""

from __future__ import annotations

import threading
import time

import psutil

MB = 2**20


class PeakRss:
    """`with PeakRss() as peak: ...`, then `peak.growth_mb`: the highest RSS sampled minus the RSS at entry."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s, self.base, self.peak = interval_s, 0, 0
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        self.peak = max(self.peak, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakRss":
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True, name="cs3-rss-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB


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
