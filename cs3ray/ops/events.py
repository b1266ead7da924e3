"""A run's JSONL event log: written by the driver, read back by `cs3 runs ls`, `cs3 report` and resumes.

On a local filesystem the log is one `events.jsonl`, appended to in place. Object stores cannot
append, and rewriting one whole log at every poll costs bytes that grow with the square of a run's
length, so there the log is numbered segments, `events/00000000.jsonl`, `events/00000001.jsonl`, ...:
a flush rewrites only the current, small segment, and a resumed run starts a new one. Every reader
takes `events.jsonl` (a local run's log, or an object-store run's from before segments) and then the
segments in order, whichever of them exist: one reading path for both.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from cs3ray.config.redact import redact_values
from cs3ray.storage import Storage, is_remote, open_private

EVENTS = "events.jsonl"
SEGMENTS = "events"
_SEGMENT = re.compile(r"(\d+)\.jsonl")
# A segment is written at most SEGMENT_WRITES times (each line is PUT about 5.5 times, 10 at most:
# bytes linear in the log) and object-store flushes come at most every REMOTE_FLUSH_S, so a 30-day run
# with new events at every 1 s poll makes one segment per >= 200 s: at most 12,960 objects.
SEGMENT_WRITES = 10
REMOTE_FLUSH_S = 20.0
SEGMENT_BYTES = 4 << 20  # a burst of events rolls sooner: no PUT carries more than this plus one flush
READ_THREADS = 16  # segments fetched at once by a reader (object stores answer each GET in tens of ms)


def segment_name(index: int) -> str:
    return f"{SEGMENTS}/{index:08d}.jsonl"


def segment_indices(run: Storage) -> list[int]:
    """The numbers of the run's event segments, in order (none for a local run or one from before segments)."""
    return sorted(int(m.group(1)) for m in map(_SEGMENT.fullmatch, run.ls(SEGMENTS)) if m)


def has_events(run: Storage) -> bool:
    """Whether the run has an event log of either form."""
    return run.exists(EVENTS) or bool(segment_indices(run))


def parse_events(text: str) -> list[dict[str, Any]]:
    """The events of one JSONL file, skipping a torn last line (a driver killed mid-write)."""
    events = []
    for line in text.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "event" in e:
            events.append(e)
    return events


def read_events(run: Storage) -> list[dict[str, Any]]:
    """Every event of the run, once each, in the order the driver logged them: `events.jsonl`, then the segments."""
    files = ([EVENTS] if run.exists(EVENTS) else []) + [segment_name(i) for i in segment_indices(run)]
    if len(files) <= 1:
        texts = [run.read_text(f) for f in files]
    else:
        with ThreadPoolExecutor(min(READ_THREADS, len(files)), thread_name_prefix="cs3-events") as pool:
            texts = list(pool.map(run.read_text, files))
    # Each file parsed alone: a torn line at the end of one cannot swallow the first line of the next.
    return [e for text in texts for e in parse_events(text)]


class EventLog:
    """The driver's writer of a run's event log (progress, eval, checkpoint, summary), append-only.

    `flush(force=False)`, at every poll, writes what is pending: at once to a local file, and to an
    object store when REMOTE_FLUSH_S have passed since its last write (so a reader sees events at
    most that late); `flush()` writes now, as the driver does when the run ends.
    """

    def __init__(self, run: Storage, clock: Callable[[], float] = time.monotonic) -> None:
        self.run = run
        self._clock = clock
        self._pending: list[str] = []
        self._remote = is_remote(run.url)
        self._last_write = -float("inf")
        if not self._remote:
            run.makedirs()
            self._separate = not _ends_a_line(run.path(EVENTS))
            return
        # The segment being written: its lines, and how often it was PUT. A resumed run starts a new one
        # rather than read and rewrite the last: earlier segments are never written again.
        done = segment_indices(run)
        self._segment = done[-1] + 1 if done else 0
        self._lines: list[str] = []
        self._bytes = self._writes = 0

    def add(self, event: dict[str, Any]) -> None:
        event = {"time": round(time.time(), 3), **event}
        self._pending.append(json.dumps(redact_values(event), sort_keys=True))  # a URL's password, say

    def flush(self, force: bool = True) -> None:
        if not self._pending:
            return
        if not self._remote:
            # A killed driver may have left a torn line: start on a line of our own, so no event is lost.
            text = ("\n" if self._separate else "") + "\n".join(self._pending) + "\n"
            with open_private(self.run.path(EVENTS), "a") as f:
                f.write(text)
            self._pending, self._separate = [], False
            return
        if not force and self._clock() - self._last_write < REMOTE_FLUSH_S:
            return
        lines = self._lines + self._pending
        text = "\n".join(lines) + "\n"
        self.run.write_text(text, segment_name(self._segment))  # pending events stay pending if this fails
        self._last_write = self._clock()
        self._lines, self._pending = lines, []
        self._bytes, self._writes = len(text), self._writes + 1
        if self._writes >= SEGMENT_WRITES or self._bytes >= SEGMENT_BYTES:
            self._segment += 1
            self._lines, self._bytes, self._writes = [], 0, 0


def _ends_a_line(path: str) -> bool:
    """True when the local file at `path` is missing, empty or ends with a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) == b"\n"
    except OSError:  # missing, or empty (a seek before the start)
        return True
