"""A followed training job's log as `cs3 train` shows its progress: its JSON event lines rendered.

`jobs/train.py` prints one JSON object per event (what scripts and `--raw` read); a person
following the job gets a line per step window, validation, checkpoint and restart instead. Lines
that are not events (Ray's, the user's own) pass through unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Callable


def event_line(e: dict[str, Any]) -> str | None:
    """One readable line for an event, or None for events `cs3 train` does not print either."""
    kind = e.get("event")
    if "summary" in e and isinstance(e["summary"], dict):
        s = e["summary"]
        return (f"run {s.get('run')}: {s.get('steps')} steps on {s.get('workers')} workers, validation loss "
                f"{_num(s.get('initial_val_loss'), 4)} -> {_num(s.get('final_val_loss'), 4)}, "
                f"{_num(s.get('tokens_per_s'), 0, ',')} tokens/s; checkpoint: {s.get('checkpoint')}")
    if kind == "start":
        return f"{e.get('workers')} workers, {e.get('params', 0):,} parameters, from step {e.get('step')} to " \
               f"{e.get('total_steps')}"
    if kind == "progress":
        return f"step {e.get('step')}: loss {_num(e.get('loss'), 3)}, {_num(e.get('tokens_per_s'), 0, ',')} tokens/s" \
               + (f", {e['workers']} workers" if "workers" in e else "")
    if kind == "eval":
        return f"step {e.get('step')}: validation loss {_num(e.get('val_loss'), 4)}"
    if kind == "checkpoint":
        return f"checkpoint step {e.get('step')} -> {e.get('url')} ({_num(e.get('seconds'), 1)}s)"
    if kind == "restart":
        return f"restart {e.get('attempt')}: {e.get('cause')}"
    if kind == "restored":
        return f"resumed from step {e.get('step')}"
    if kind == "stopping":
        return "stopping: taking a checkpoint"
    return None


def _num(value: Any, digits: int, sep: str = "") -> str:
    return f"{value:{sep}.{digits}f}" if isinstance(value, (int, float)) else "?"


class Renderer:
    """Feeds text chunks of a log, writes whole lines: events rendered (unless raw), the rest as they are."""

    def __init__(self, write: Callable[[str], None], raw: bool = False) -> None:
        self.write, self.raw, self.partial = write, raw, ""

    def __call__(self, text: str) -> None:
        if self.raw:
            self.write(text)
            return
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self._line(line)

    def close(self) -> None:
        if self.partial:
            self._line(self.partial)
            self.partial = ""

    def _line(self, line: str) -> None:
        shown: str | None = line
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and ("event" in obj or "summary" in obj):
                shown = event_line(obj)
        if shown is not None:
            self.write(shown + "\n")
