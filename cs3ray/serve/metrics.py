"""Engine metrics exported through Ray's metrics (Prometheus on the cluster's metrics port)."""

from __future__ import annotations

_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


class RayMetrics:
    """TTFT, inter-token latency, queue length and generated tokens of one replica."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self._ttft = metrics.Histogram("cs3_serve_ttft_ms", "Time to first token (ms).", boundaries=_MS)
        self._itl = metrics.Histogram("cs3_serve_itl_ms", "Inter-token latency (ms).", boundaries=_MS)
        self._waiting = metrics.Gauge("cs3_serve_queue_waiting", "Requests waiting for a KV cache slot.")
        self._running = metrics.Gauge("cs3_serve_running", "Sequences in the running batch.")
        self._tokens = metrics.Counter("cs3_serve_generated_tokens", "Generated tokens (rate() gives tokens/s).")

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds * 1e3)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds * 1e3)

    def queue(self, waiting: int, running: int) -> None:
        self._waiting.set(waiting)
        self._running.set(running)

    def tokens(self, n: int) -> None:
        self._tokens.inc(n)
