"""Preemption notices: a node of the run being drained, or SIGTERM in a worker process.

Ray drains a node with a deadline when a spot instance is being reclaimed (`ray drain-node ... --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`, what autoscalers call); the node keeps running
until the platform takes it. The run's monitor reads the GCS's draining nodes once a second (one RPC,
whatever the number of ranks: `DrainWatcher`) and answers rank 0's once-a-step question with the notice;
the vote rides the all-reduce every step already makes, so every rank snapshots the same step. The ranks
then wait, training nothing more, until Ray Train ends the group at the deadline (or the node's loss ends
it sooner) and restarts it on the remaining nodes from that snapshot: no step is lost or trained twice.

SIGTERM (a pod or process being stopped with a grace period) is caught by a handler that the training
backend installs on each worker actor's main thread: that rank votes for the same snapshot, after which
the group ends at once and Ray Train restarts it from the snapshot (cluster.max_failures).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

POLL_S = 1.0  # seconds between the monitor's reads of the GCS's draining nodes
# A drain without a deadline: Ray Train waits this long after noticing it before it restarts the group.
NO_DEADLINE_S = 120.0
# Past the deadline, the time Ray Train has to end the group itself before a rank ends its attempt.
TEARDOWN_GRACE_S = 30.0

SIGTERM_RECEIVED = threading.Event()  # set by the handler; read by the training thread at a step boundary
_previous: Any = None  # the handler SIGTERM had before ours (Ray's: exit), for a second SIGTERM


class Preempted(RuntimeError):
    """This attempt ends on a preemption notice, with its snapshot taken: Ray Train restarts it from there."""


def draining_nodes() -> dict[str, int]:
    """The GCS's draining nodes: node id (hex) -> deadline (UNIX ms; 0 when the drain has none)."""
    import ray

    return dict(ray._private.state.state.get_draining_nodes() or {})


class DrainWatcher:
    """A daemon thread that reads the draining nodes every `poll_s` and calls `on_drains` with them."""

    def __init__(self, on_drains: Callable[[dict[str, int]], None], poll_s: float = POLL_S,
                 read: Callable[[], dict[str, int]] = draining_nodes) -> None:
        self._on_drains, self._poll_s, self._read = on_drains, poll_s, read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cs3-drain-watcher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                drains = self._read()
            except Exception:  # noqa: BLE001 - a GCS hiccup: the next poll tries again
                log.debug("reading the draining nodes failed", exc_info=True)
                continue
            self._on_drains(drains)

    def stop(self) -> None:
        self._stop.set()


def drain_notice(drains: dict[str, int], nodes: set[str], now: float) -> dict[str, Any] | None:
    """The `preemption` event for the drains (`draining_nodes()`) that hit `nodes`, or None.

    `deadline`: the earliest of their deadlines (UNIX seconds), None when none has one."""
    hit = sorted(n for n in drains if n in nodes)
    if not hit:
        return None
    deadlines = [drains[n] / 1000 for n in hit if drains[n]]
    return {"event": "preemption", "wall": now, "notice": "drain", "nodes": hit,
            "deadline": min(deadlines) if deadlines else None}


def install_sigterm_handler() -> None:
    """On a worker actor's main thread (the only one that may set handlers): SIGTERM asks for a snapshot.

    A second SIGTERM goes to the previous handler (Ray's exits the process)."""
    global _previous

    def on_sigterm(signum: int, frame: Any) -> None:
        if SIGTERM_RECEIVED.is_set() and callable(_previous):
            _previous(signum, frame)
            return
        SIGTERM_RECEIVED.set()

    SIGTERM_RECEIVED.clear()  # a new worker group in a reused process starts without a notice
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    if getattr(previous, "__qualname__", "").endswith("on_sigterm"):
        return  # installed before in this process: keep the original previous handler
    _previous = previous


def wait_for_teardown(deadline: float | None, detected: float, step: int,
                      clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                      grace_s: float = TEARDOWN_GRACE_S) -> None:
    """After a drain's snapshot: train nothing more until Ray Train ends the group; raises `Preempted`.

    Ray Train ends it when the deadline passes (NO_DEADLINE_S after the notice without one), or sooner
    when the drained node's loss ends it; a rank still here `grace_s` later ends the attempt itself."""
    until = (deadline if deadline else detected + NO_DEADLINE_S) + grace_s
    while (left := until - clock()) > 0:
        sleep(min(left, 1.0))
    raise Preempted(f"the node was drained for a preemption and Ray Train did not restart the group by "
                    f"{grace_s:g} s past its deadline; the snapshot of step {step} is taken")
