"""Carry engine events from the thread that receives them into an asyncio loop, one wake-up per engine step."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from .sequence import Event


class EventPump:
    """Events are queued under a lock and delivered in the loop by one scheduled callback.

    A decode step emits an event per running sequence; waking the loop for each one
    (call_soon_threadsafe writes to a pipe) would cost more than the step at large batches.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._outbox: list[tuple[Callable[[Event], None], Event]] = []
        self._wake_pending = False

    def emitter(self, deliver: Callable[[Event], None]) -> Callable[[Event], None]:
        """A thread-safe callback for the engine; `deliver` later runs in the loop with each event."""
        def emit(ev: Event) -> None:
            with self._lock:
                self._outbox.append((deliver, ev))
                wake, self._wake_pending = not self._wake_pending, True
            if wake:
                self.loop.call_soon_threadsafe(self._drain)
        return emit

    def _drain(self) -> None:
        with self._lock:
            batch, self._outbox, self._wake_pending = self._outbox, [], False
        for deliver, ev in batch:
            deliver(ev)


class Pacer:
    """How often each stream of a replica may send a chunk: at most every `floor_s`, and under
    load less often, so that all streams together send at most `events_per_s` chunks.

    Every chunk costs the replica and Serve's proxy the same fixed work (a Ray message each
    way, whatever its size), far more than a decode step's share of one token. Tokens decoded
    in between go out together in the next chunk, as OpenAI streams allow.
    """

    def __init__(self, floor_s: float, events_per_s: float) -> None:
        self.floor_s, self.events_per_s = floor_s, events_per_s
        self.active = 0  # streams being paced right now

    def interval(self) -> float:
        return max(self.floor_s, self.active / self.events_per_s)
