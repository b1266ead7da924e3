"""What a run directory says about itself: its events, summary, status and checkpoints (`cs3 runs ls`)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from cs3ray.ckpt import list_steps, step_dir
from cs3ray.config.runs import open_run
from cs3ray.errors import UserError
from cs3ray.storage import Storage, StorageError, open_url

from .events import EVENTS, SEGMENTS, has_events, read_events

SUMMARY = "summary.json"
CONFIG = "config.yaml"

# Without an `end` event after the last `start`, the events cannot tell a run still training from one
# whose driver died (killed, a node lost, a failure past cluster.max_failures): say both.
FINISHED, STOPPED, UNFINISHED, NO_EVENTS = "finished", "stopped", "running or interrupted", "no events"


class RunError(UserError):
    """A run that does not exist or cannot be read."""


@dataclass
class RunRecord:
    """One run as its files describe it."""

    storage: Storage
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    checkpoints: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.storage.url.rstrip("/").rsplit("/", 1)[-1]

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind, in order."""
        return [e for e in self.events if e.get("event") == kind]

    @property
    def status(self) -> str:
        if not self.events:
            return NO_EVENTS
        starts = [i for i, e in enumerate(self.events) if e.get("event") == "start"]
        end = next((e for e in self.events[starts[-1] if starts else 0:] if e.get("event") == "end"), None)
        if end is None:
            return UNFINISHED
        return STOPPED if end.get("stopped") else FINISHED

    @property
    def step(self) -> int:
        """The furthest step any event reports."""
        return max((int(e["step"]) for e in self.events if isinstance(e.get("step"), (int, float))), default=0)

    @property
    def total_steps(self) -> int | None:
        starts = self.of("start")
        return starts[-1].get("total_steps") if starts else None

    @property
    def best_val_loss(self) -> float | None:
        losses = [e["val_loss"] for e in self.of("eval") if _finite(e.get("val_loss"))]
        return min(losses) if losses else None

    @property
    def last_event_time(self) -> float | None:
        return self.events[-1].get("time") if self.events else None

    def checkpoint_url(self) -> str | None:
        return self.storage.child(step_dir(self.checkpoints[-1])).url if self.checkpoints else None

    def overview(self) -> dict[str, Any]:
        """The row `cs3 runs ls` shows (and prints as JSON)."""
        last = self.last_event_time
        return {"run": self.name, "url": self.storage.url, "status": self.status, "step": self.step,
                "total_steps": self.total_steps, "best_val_loss": self.best_val_loss,
                "final_val_loss": (self.summary or {}).get("final_val_loss"),
                "checkpoint_step": self.checkpoints[-1] if self.checkpoints else None,
                "checkpoint": self.checkpoint_url(), "restores": len(self.of("restored")),
                "last_event": last, "last_event_age_s": round(time.time() - last, 1) if last else None}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def read_run(storage: Storage) -> RunRecord:
    """A run's events, summary and complete checkpoints (each may be missing)."""
    events = read_events(storage)
    summary = None
    if storage.exists(SUMMARY):
        try:
            summary = json.loads(storage.read_text(SUMMARY))
        except ValueError:
            summary = None  # a torn summary: the events still say what happened
    return RunRecord(storage, events, summary if isinstance(summary, dict) else None, list_steps(storage))


def load_run(run: str, storage_options: dict | None = None) -> RunRecord:
    """The run named `run` (a name under runs/, a path or a URL); a missing or event-less run is a RunError."""
    storage = open_run(run, storage_options, RunError)
    try:
        record = read_run(storage)
    except StorageError as exc:
        raise RunError(str(exc)) from None
    if not record.events:
        raise RunError(f"run '{run}' has no events ('{storage.url}' holds neither a non-empty {EVENTS} nor "
                       f"{SEGMENTS}/ segments): it has not started training.")
    return record


def list_runs(runs_dir: str, storage_options: dict | None = None) -> list[RunRecord]:
    """Every run below `runs_dir` (folders holding events, a summary or a config), by name."""
    root = open_url(runs_dir, storage_options)
    try:
        if not root.exists():
            raise RunError(f"no runs directory at '{root.url}'; pass --dir where your runs are.")
        records = []
        for name in root.ls():
            child = root.child(name)
            if has_events(child) or any(child.exists(f) for f in (SUMMARY, CONFIG)):
                records.append(read_run(child))
    except StorageError as exc:
        raise RunError(str(exc)) from None
    return records
