"""A small actor between the driver and the workers: progress events in, stop requests out."""

from __future__ import annotations

from typing import Any

import ray

from .restarts import RestartExplainer


@ray.remote(num_cpus=0)
class RunMonitor:
    """Rank 0 records events; the driver reads them and may ask the workers to stop."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._stop = False
        self._restarts = RestartExplainer()

    def record(self, event: dict[str, Any]) -> None:
        restart = self._restarts.before(event)  # a restarted group's start: first say why it restarted
        if restart is not None:
            self._events.append(restart)
        self._events.append(event)

    def events_since(self, index: int) -> list[dict[str, Any]]:
        return self._events[index:]

    def request_stop(self) -> None:
        self._stop = True

    def should_stop(self) -> bool:
        return self._stop
