"""Engine metrics exported through Ray's metrics (Prometheus on the cluster's metrics port)."""

from __future__ import annotations

import socket

# Latencies in seconds, from 1 ms to 30 s (a first token behind a long queue).
_SECONDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
# Tags of every series: the Serve application and deployment, and the node's host name. No
# replica tag (a process's, as ray.serve.metrics adds): replicas of a node add up in a query.
TAG_KEYS = ("application", "deployment", "node")

# name -> (Prometheus type, description); on the endpoint with Ray's "ray_" prefix (a counter also "_total").
SERVE_METRICS: dict[str, tuple[str, str]] = {
    "cs3_serve_ttft_seconds": ("histogram", "Time to first token (seconds)."),
    "cs3_serve_inter_token_seconds": ("histogram", "Time between two tokens of a sequence (seconds)."),
    "cs3_serve_queue_waiting": ("gauge", "Requests waiting for a KV cache slot."),
    "cs3_serve_running": ("gauge", "Sequences in the running batch."),
    "cs3_serve_generated_tokens": ("counter", "Generated tokens (rate() gives tokens/s)."),
}


def _tags() -> dict[str, str]:
    """This replica's application and deployment (empty outside a Serve replica) and node."""
    app = deployment = ""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        app, deployment = ctx.app_name or "", ctx.deployment
    except Exception:  # noqa: BLE001 - not in a replica (an engine under test)
        pass
    return {"application": app, "deployment": deployment, "node": socket.gethostname()}


class RayMetrics:
    """TTFT, inter-token latency, queue length and generated tokens of one replica."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        tags = _tags()

        def make(name: str):
            kind, desc = SERVE_METRICS[name]
            if kind == "histogram":
                m = Histogram(name, desc, boundaries=_SECONDS, tag_keys=TAG_KEYS)
            else:
                m = (Gauge if kind == "gauge" else Counter)(name, desc, tag_keys=TAG_KEYS)
            m.set_default_tags(tags)
            return m

        self._ttft, self._itl = make("cs3_serve_ttft_seconds"), make("cs3_serve_inter_token_seconds")
        self._waiting, self._running = make("cs3_serve_queue_waiting"), make("cs3_serve_running")
        self._tokens = make("cs3_serve_generated_tokens")

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def queue(self, waiting: int, running: int) -> None:
        self._waiting.set(waiting)
        self._running.set(running)

    def tokens(self, n: int) -> None:
        if n > 0:  # a Ray counter takes positive increments only
            self._tokens.inc(n)
