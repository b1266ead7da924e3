"""Following a Ray job's logs to its end through a stream that may drop.

Ray's log stream (a websocket to the dashboard) ends when the dashboard restarts, a proxy or load
balancer times it out, or the network blips, while the job runs on. `follow` then reconnects with
a backoff until the job API answers again (within `reconnect_s`), and since every new stream
starts from the beginning of the job's log, it skips what was already printed: each line once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from .cluster import ClusterError
from .jobs import TERMINAL, Dashboard, call, client

RECONNECT_S = 300.0  # how long the job API may stay away before following gives up
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # waits between attempts, the last repeated


def follow(dashboard: Dashboard, job_id: str, out: Callable[[str], None], note: Callable[[str], None] = lambda _: None,
           reconnect_s: float = RECONNECT_S, sleep: Callable[[float], None] = time.sleep) -> str:
    """Print the job's log as it comes until the job ends; returns its final status.

    `out` gets the log's text, each character once across reconnections; `note` one line each time the
    stream drops and when it is back. An unknown job is a ClusterError at once; a job API away for more
    than `reconnect_s` seconds is one too (the job may still be running).
    """
    printed = _Printed()
    down_since: float | None = None
    attempt = 0
    while True:
        try:
            return _stream_to_end(dashboard, job_id, printed, out)
        except ClusterError as exc:
            if "no such job" in str(exc) or "refused the auth token" in str(exc):
                raise
            error: BaseException = exc
        except Exception as exc:  # noqa: BLE001 - websocket, HTTP and connection errors alike
            error = exc
        now = time.monotonic()
        if down_since is None:
            down_since, attempt = now, 0
            note(f"log stream of job {job_id} dropped ({_first_line(error)}); reconnecting")
        elif now - down_since > reconnect_s:
            raise ClusterError(f"the job API at {dashboard.url} did not answer for {reconnect_s:.0f} s "
                               f"({_first_line(error)}); job {job_id} may still be running: "
                               f"`cs3 jobs status {job_id}` once the cluster is reachable.") from None
        sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        attempt += 1
        if _answers(dashboard, job_id):
            note(f"reconnected to job {job_id} after {time.monotonic() - down_since:.0f} s")
            down_since = None


def _stream_to_end(dashboard: Dashboard, job_id: str, printed: "_Printed", out: Callable[[str], None]) -> str:
    """One stream of the log to its end; the job's final status, or an error if it ended before the job."""
    jobs = client(dashboard)
    _tail(jobs, job_id, printed, out)
    status = str(call(dashboard, lambda: jobs.get_job_status(job_id)).value)
    if status not in TERMINAL:
        raise ConnectionError("the log stream ended while the job runs")
    # A stream cut just as the job ended may miss its last lines: the stored log has them.
    rest = call(dashboard, lambda: jobs.get_job_logs(job_id))[printed.n:]
    if rest:
        out(rest)
        printed.n += len(rest)
    return status


class _Printed:
    """Characters of the log given to `out` so far, counted as they go (a stream may fail mid-way)."""

    def __init__(self) -> None:
        self.n = 0


def _tail(jobs, job_id: str, printed: _Printed, out: Callable[[str], None]) -> None:
    """Stream the job's log from its start, giving `out` only what lies past what was printed."""
    async def tail() -> None:
        seen = 0
        async for chunk in jobs.tail_job_logs(job_id):
            if seen + len(chunk) > printed.n:
                new = chunk[printed.n - seen:] if printed.n > seen else chunk
                out(new)
                printed.n += len(new)
            seen += len(chunk)

    asyncio.run(tail())


def _answers(dashboard: Dashboard, job_id: str) -> bool:
    try:
        jobs = client(dashboard)
        jobs.get_job_status(job_id)
        return True
    except Exception:  # noqa: BLE001 - not yet: the caller waits and tries again
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
