"""The peak resident memory of this process while a block of code runs (what a preparation reports, and
the growth `cs3 bench data` shows for a driver that gathers a corpus against one that only plans)."""

from __future__ import annotations

import threading
from types import TracebackType

import psutil

INTERVAL_S = 0.02  # RSS sampled this often: a peak shorter than this may be missed
MB = 2**20


class PeakRss:
    """`with PeakRss() as peak: ...`, then `peak.mb`: the largest RSS sampled in a thread meanwhile, and
    `peak.growth_mb`: that peak less the RSS at entry."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self._proc, self._interval = psutil.Process(), interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cs3-peak-rss")
        self.base = self.peak = 0

    def _sample(self) -> None:
        self.peak = max(self.peak, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def __enter__(self) -> "PeakRss":
        self.base = self._proc.memory_info().rss
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def mb(self) -> float:
        return round(self.peak / MB, 1)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB
