"""Serve on the session's head for one test module, started and shut down around it."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


def _controller_gone(timeout_s: float = 60.0) -> None:
    """Wait until no Serve controller is left on the cluster. `serve.shutdown()` returns before the controller
    has exited; a `serve.start` in that window reaches the exiting controller (SystemExit on a loaded host)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.5)
    raise TimeoutError(f"an earlier Serve controller was still there after {timeout_s:.0f} s")


@contextlib.contextmanager
def serve_running(port: int, host: str = "127.0.0.1") -> Iterator[int]:
    """Serve's proxy on host:port, shut down on exit (whatever the test left deployed)."""
    from ray import serve

    _controller_gone()
    try:
        serve.start(http_options={"host": host, "port": port})
        yield port
    finally:
        serve.shutdown()
