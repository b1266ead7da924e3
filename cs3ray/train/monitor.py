"""A small actor between the driver and the workers: progress events in, stop and preemption requests out."""

from __future__ import annotations

import threading
import time
from typing import Any

import ray

from .preemption import DrainWatcher, drain_notice
from .restarts import RestartExplainer


@ray.remote(num_cpus=0)
class RunMonitor:
    """Rank 0 records events; the driver reads them and may ask the workers to stop; a watcher of the GCS's
    draining nodes notices a drain of a node the worker group runs on (train/preemption.py)."""

    def __init__(self, watch_drains: bool = True) -> None:
        self._events: list[dict[str, Any]] = []
        self._stop = False
        self._restarts = RestartExplainer()
        self._lock = threading.Lock()  # the watcher's thread adds events too
        self._nodes: set[str] = set()  # the current worker group's nodes (its start event's)
        self._notice: dict[str, Any] | None = None  # the current group's drain notice
        self._watcher = DrainWatcher(self._on_drains) if watch_drains else None

    def record(self, event: dict[str, Any]) -> None:
        with self._lock:
            if event.get("event") == "start":  # a new group: a notice of the previous one is spent
                self._nodes, self._notice = set(event.get("node_ids") or ()), None
            self._add(event)

    def _add(self, event: dict[str, Any]) -> None:
        restart = self._restarts.before(event)  # a restarted group's start: first say why it restarted
        if restart is not None:
            self._events.append(restart)
        self._events.append(event)

    def _on_drains(self, drains: dict[str, int]) -> None:
        with self._lock:
            if self._notice is None and (notice := drain_notice(drains, self._nodes, time.time())):
                self._notice = notice
                self._add(notice)

    def events_since(self, index: int) -> list[dict[str, Any]]:
        return self._events[index:]

    def request_stop(self) -> None:
        self._stop = True

    def control(self) -> tuple[bool, float | None]:
        """Rank 0's question at every step: stop?, and the seconds left before a drain's deadline (0 for a drain
        without one), or None while no node of the group is being drained."""
        notice = self._notice
        if notice is None:
            return self._stop, None
        return self._stop, max(notice["deadline"] - time.time(), 1e-3) if notice["deadline"] else 0.0
