"""Retries with exponential backoff up to a deadline, each attempt bounded by what is left of it."""

from __future__ import annotations

import random
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """Every attempt failed (or hung) until the deadline; carries the last error and attempt count."""

    def __init__(self, last: BaseException | None, attempts: int, seconds: float) -> None:
        super().__init__(str(last) if last else "timed out")
        self.last, self.attempts, self.seconds = last, attempts, seconds


def _bounded(fn: Callable[[], T], timeout: float) -> T:
    # A hung request must not outlive the deadline: run it in a daemon thread and stop waiting.
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="cs3-cache-l3")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:.1f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def retry(fn: Callable[[], T], deadline_s: float, permanent: tuple[type[BaseException], ...] = (),
          on_retry: Callable[[BaseException], None] | None = None,
          base_s: float = 0.1, max_sleep_s: float = 2.0) -> T:
    """`fn()`, retried with jittered exponential backoff until `deadline_s` has passed.

    Exceptions of a `permanent` type (a missing file) are raised at once; retrying cannot help.
    """
    start = time.monotonic()
    attempt, last = 0, None
    while True:
        left = deadline_s - (time.monotonic() - start)
        if left <= 0:
            raise DeadlineExceeded(last, attempt, time.monotonic() - start)
        attempt += 1
        try:
            return _bounded(fn, left)
        except permanent:
            raise
        except Exception as exc:  # noqa: BLE001 - storage clients raise many types; all are retried
            last = exc
            if on_retry:
                on_retry(exc)
        sleep = min(max_sleep_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        time.sleep(max(0.0, min(sleep, deadline_s - (time.monotonic() - start))))
