"""A rank's compute time for train.balance (cs3ray.core.busy): waits are not compute, a lost core slice is."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from cs3ray.core import busy
from cs3ray.core.busy import BusyClock, thread_busy_s


def _spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def test_a_wait_is_not_compute_and_work_is():
    clock = BusyClock(torch.device("cpu"))
    clock.begin()
    time.sleep(0.3)  # as a collective's wait for a slower rank, or for data from a loader thread
    clock.end()
    assert clock.seconds < 0.05
    clock.begin()
    _spin(0.2)
    clock.end()
    assert clock.seconds >= 0.15


@pytest.mark.skipif(not busy.SCHEDSTAT.exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux schedstat and CPU affinity")
def test_time_lost_to_a_process_sharing_the_core_counts_as_compute():
    # A noisy neighbour on the same core: the thread's CPU time sees about half of the wall time, its
    # compute time (run + run-queue delay) sees all of it.
    core = max(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    result: dict[str, float] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        _spin(0.1)  # let the neighbour start competing
        wall, cpu, busy_0 = time.perf_counter(), time.thread_time(), thread_busy_s()
        _spin(1.0)
        result.update(wall=time.perf_counter() - wall, cpu=time.thread_time() - cpu, busy=thread_busy_s() - busy_0)

    try:
        os.sched_setaffinity(hog.pid, {core})
        thread = threading.Thread(target=pinned)
        thread.start()
        thread.join()
    finally:
        hog.kill()
        hog.wait()
    assert result["busy"] >= 0.9 * result["wall"], result
    assert result["cpu"] <= 0.75 * result["wall"], result


class _Event:
    """torch.cuda.Event on a host without a GPU: records a position on a simulated device clock (ms)."""

    device_ms = 0.0
    synchronized: list[_Event] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _Event.device_ms

    def synchronize(self) -> None:
        _Event.synchronized.append(self)

    def query(self) -> bool:
        return False  # the simulated device is still busy: nothing is folded before the figure is read

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_on_a_gpu_compute_is_device_time_between_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    clock = BusyClock(torch.device("cuda", 0))
    for ms in (120.0, 80.0):
        clock.begin()
        _Event.device_ms += ms  # the kernels the step queued
        clock.end()
        _Event.device_ms += 500.0  # between steps: not compute
    assert _Event.synchronized == []  # nothing waits for the device until the figure is read
    assert clock.seconds == pytest.approx(0.2)
    assert len(_Event.synchronized) == 1  # the last span's end only
    assert clock.seconds == pytest.approx(0.2)  # read twice, counted once
