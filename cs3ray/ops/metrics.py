"""Run metrics: a JSONL event log per run, and Ray metrics (Prometheus) for live dashboards."""

from __future__ import annotations

import json
import time
from typing import Any

from cs3ray.storage import Storage, is_remote

EVENTS = "events.jsonl"


class EventLog:
    """Append-only JSONL of a run's events (progress, eval, checkpoint, summary).

    Local files are appended line by line; object stores cannot append, so there the whole
    log is rewritten (atomically) on flush. Runs log a few hundred lines, so that stays cheap.
    """

    def __init__(self, run: Storage) -> None:
        self.run = run
        self.lines: list[str] = []
        self._flushed = 0
        self._remote = is_remote(run.url)
        if not self._remote:
            run.makedirs()
        elif run.exists(EVENTS):
            self.lines = run.read_text(EVENTS).splitlines()
            self._flushed = len(self.lines)

    def add(self, event: dict[str, Any]) -> None:
        event = {"time": round(time.time(), 3), **event}
        self.lines.append(json.dumps(event, sort_keys=True))

    def flush(self) -> None:
        if self._flushed == len(self.lines):
            return
        if self._remote:
            self.run.write_text("\n".join(self.lines) + "\n", EVENTS)
        else:
            with open(self.run.path(EVENTS), "a") as f:
                f.write("\n".join(self.lines[self._flushed:]) + "\n")
        self._flushed = len(self.lines)


class TrainGauges:
    """Prometheus gauges exported through Ray's metrics agent (rank 0 sets them)."""

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Gauge

        tags = {"run": run_name}
        names = {"loss": "training loss", "val_loss": "validation loss", "tokens_per_s": "global tokens per second",
                 "step_time_s": "seconds per optimizer step", "step": "optimizer step", "lr": "learning rate",
                 "mfu": "model FLOPs utilisation (0-1)",
                 "comm_bytes_per_step": "gradient bytes a rank sent per step (compressed sync only)",
                 "wire_ratio": "gradient bytes sent / an fp32 ring all-reduce's (compressed sync only)"}
        self._gauges = {}
        for key, desc in names.items():
            g = Gauge(f"cs3_train_{key}", description=desc, tag_keys=("run",))
            g.set_default_tags(tags)
            self._gauges[key] = g

    def update(self, values: dict[str, Any]) -> None:
        for key, g in self._gauges.items():
            v = values.get(key)
            if isinstance(v, (int, float)):
                g.set(float(v))
