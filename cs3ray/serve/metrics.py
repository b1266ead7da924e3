"""Engine metrics exported through Ray's metrics (Prometheus on the cluster's metrics port)."""

from __future__ import annotations

_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


# name -> (Prometheus type, description); on the endpoint with Ray's "ray_" prefix.
SERVE_METRICS: dict[str, tuple[str, str]] = {
    "cs3_serve_ttft_ms": ("histogram", "Time to first token (ms)."),
    "cs3_serve_itl_ms": ("histogram", "Inter-token latency (ms)."),
    "cs3_serve_queue_waiting": ("gauge", "Requests waiting for a KV cache slot."),
    "cs3_serve_running": ("gauge", "Sequences in the running batch."),
    "cs3_serve_generated_tokens": ("counter", "Generated tokens (rate() gives tokens/s)."),
}


class RayMetrics:
    """TTFT, inter-token latency, queue length and generated tokens of one replica."""

    def __init__(self) -> None:
        from ray.serve import metrics

        def make(name: str):
            kind, desc = SERVE_METRICS[name]
            if kind == "histogram":
                return metrics.Histogram(name, desc, boundaries=_MS)
            return (metrics.Gauge if kind == "gauge" else metrics.Counter)(name, desc)

        self._ttft, self._itl = make("cs3_serve_ttft_ms"), make("cs3_serve_itl_ms")
        self._waiting, self._running = make("cs3_serve_queue_waiting"), make("cs3_serve_running")
        self._tokens = make("cs3_serve_generated_tokens")

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds * 1e3)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds * 1e3)

    def queue(self, waiting: int, running: int) -> None:
        self._waiting.set(waiting)
        self._running.set(running)

    def tokens(self, n: int) -> None:
        self._tokens.inc(n)
