"""Why the worker group restarted: each restart gets a `restart` event naming its cause.

A worker that fails reports its error to the run's monitor before its exception reaches Ray Train
(`failure` events); when the restarted group starts, the monitor puts a `restart` event before its
`start` with the last failure's error, or, when none was reported, what else ends a group: a
resize to another worker count, or a process that died without a word (SIGKILL, the OOM killer, a
lost node). A preemption notice (`preemption` events: a drained node, a SIGTERM) names the restart that
follows it, before any error the group's end raised.
"""

from __future__ import annotations

import time
from typing import Any

DIED = "a worker process died without reporting an error (killed, out of memory, or its node was lost)"
# What a survivor's collective raises when a peer process is gone (gloo, NCCL): the peer's death is the
# cause, the survivor's error only its echo.
PEER_GONE = ("connection closed by peer", "connection reset by peer", "remote process exited",
             "caused by a remote worker crashing")


def failure_event(rank: int, step: int | None, exc: BaseException) -> dict[str, Any]:
    """What a failing worker reports: its rank, the step it was at, its error in one line."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return {"event": "failure", "wall": time.time(), "rank": rank, "step": step,
            "error": f"{type(exc).__name__}: {text}" if text else type(exc).__name__}


class RestartExplainer:
    """Fed every event in order; returns the `restart` event to record before a restarted group's start."""

    def __init__(self) -> None:
        self.starts = 0
        self.workers: int | None = None
        self.failure: dict[str, Any] | None = None
        self.preemption: dict[str, Any] | None = None

    def before(self, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event.get("event")
        if kind == "failure":
            # The first error of an attempt is its cause, unless it only echoes a peer that died: a peer's
            # own error that arrives later is then the cause.
            if self.failure is None or (peer_gone(self.failure) and not peer_gone(event)):
                self.failure = event
            return None
        if kind == "preemption":
            self.preemption = self.preemption or event
            return None
        if kind != "start":
            return None
        self.starts += 1
        previous, self.workers = self.workers, event.get("workers")
        failure, self.failure = self.failure, None
        preemption, self.preemption = self.preemption, None
        if self.starts == 1:
            return None
        if preemption is not None:
            cause = preemption_cause(preemption)
        elif failure is not None and peer_gone(failure):
            cause = f"{DIED}; worker {failure['rank']} then lost its connection to it at step {failure.get('step')}"
        elif failure is not None:
            where = f" at step {failure['step']}" if failure.get("step") is not None else ""
            cause = f"worker {failure['rank']} failed{where}: {failure['error']}"
        elif previous is not None and event.get("workers") != previous:
            cause = f"the worker group was resized from {previous} to {event.get('workers')} workers"
        else:
            cause = DIED
        return {"event": "restart", "wall": event.get("wall", time.time()), "attempt": self.starts - 1,
                "step": event.get("step"), "cause": cause}


def peer_gone(failure: dict[str, Any]) -> bool:
    """A failure that only reports a peer process gone (a collective's connection closed under it)."""
    error = str(failure.get("error", "")).lower()
    return any(words in error for words in PEER_GONE)


def preemption_cause(event: dict[str, Any]) -> str:
    """A `preemption` event in words: which node was drained and with how much notice, or which rank got SIGTERM."""
    if event.get("notice") == "sigterm":
        return f"preemption: worker {event.get('rank')} received SIGTERM at step {event.get('step')}"
    nodes = ", ".join(n[:12] for n in event.get("nodes", []))
    notice = (f"with {event['deadline'] - event['wall']:.0f} s left to its deadline" if event.get("deadline")
              else "without a deadline")
    return f"preemption: node {nodes} drained {notice}"
