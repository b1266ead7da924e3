"""Run metrics: the figures a run's events carry, as Ray metrics (Prometheus) for live dashboards.

The events themselves go to the run's JSONL log (cs3ray.ops.events).
"""

from __future__ import annotations

import math
from typing import Any

# The run's Prometheus metrics: name (less the "cs3_train_" prefix) -> (type, description). On the endpoint
# each gets Ray's "ray_" prefix, a counter also "_total", a histogram "_bucket", "_sum" and "_count".
# Names carry base units (seconds, bytes); rates (tokens/s) are the dashboard's rate() of a counter.
TRAIN_METRICS: dict[str, tuple[str, str]] = {
    "loss": ("gauge", "training loss (mean over ranks, last step of the log window)"),
    "val_loss": ("gauge", "validation loss"),
    "step": ("gauge", "optimizer step"),
    "lr": ("gauge", "learning rate"),
    "mfu": ("gauge", "model FLOPs utilisation (0-1) over the log window"),
    "grad_norm": ("gauge", "global gradient norm before clipping (runs with train.clip > 0)"),
    "loss_scale": ("gauge", "fp16 loss scale"),
    "workers": ("gauge", "workers taking part in the step"),
    "step_comm_bytes": ("gauge", "gradient bytes a rank sent per step, mean over the log window (compressed sync)"),
    "wire_ratio": ("gauge", "gradient bytes sent / an fp32 ring all-reduce's (compressed sync only)"),
    "checkpoint_save_seconds": ("gauge", "seconds the last checkpoint blocked training"),
    "checkpoint_restore_seconds": ("gauge", "seconds the last restore took (a resume, retry or resize)"),
    "tokens": ("counter", "tokens trained on, all workers (rate() gives tokens/s)"),
    "skipped_steps": ("counter", "optimizer steps skipped for an inf/nan gradient"),
    "restarts": ("counter", "times the worker group started again from a checkpoint (retries, resizes)"),
    "recoveries": ("counter", "replicas that healed from a live peer without a restart (cluster.fault_tolerance=replicas)"),
    "step_seconds": ("histogram", "seconds of an optimizer step (the reporting rank's)"),
}
# Step times from 10 ms (a tiny model on a CPU) to 10 minutes (a large model's pipelined step).
STEP_SECONDS_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600]
# Gauges that are an event figure (event_figures' name) under another name.
_GAUGE_OF_FIGURE = {"comm_bytes_per_step": "step_comm_bytes", "checkpoint_save_s": "checkpoint_save_seconds",
                    "checkpoint_restore_s": "checkpoint_restore_seconds"}
# Event fields that are figures under their own name.
_COPIED = {"progress": ("loss", "tokens_per_s", "step_time_s", "step", "lr", "mfu", "grad_norm", "loss_scale",
                        "skipped_steps", "workers", "comm_bytes_per_step", "wire_ratio"),
           "eval": ("val_loss",)}


def event_figures(event: dict[str, Any]) -> dict[str, float]:
    """The figures an event carries, by name (what the optional loggers record per step; the gauges too)."""
    kind = event.get("event")
    out = {key: event.get(key) for key in _COPIED.get(kind, ())}
    if kind == "checkpoint":
        out["checkpoint_save_s"] = event.get("seconds")
    elif kind == "restored":
        out["checkpoint_restore_s"] = event.get("seconds")
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class RunMetrics:
    """A run's Prometheus metrics, set by the driver from the events its workers report (tag `run`).

    The driver sees every event of every worker-group attempt, so restarts and recoveries are
    counted where they are observed, and it is one process: one series per run. Ray's metrics
    agent drops a gauge value not reported again within two report intervals, so `refresh`
    re-sets every gauge at each of the driver's polls (a restore's seconds, set once, would
    otherwise vanish); gauges leave the endpoint that long after the driver exits, counters and
    histograms stay until the node's agent restarts, as Prometheus counters do.
    """

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self._metrics: dict[str, Any] = {}
        for key, (kind, desc) in TRAIN_METRICS.items():
            name = f"cs3_train_{key}"
            if kind == "histogram":
                m = Histogram(name, description=desc, boundaries=STEP_SECONDS_BUCKETS, tag_keys=("run",))
            else:
                m = (Counter if kind == "counter" else Gauge)(name, description=desc, tag_keys=("run",))
            m.set_default_tags({"run": run_name})
            self._metrics[key] = m
        self._starts = 0
        self._gauges: dict[str, float] = {}

    def observe(self, event: dict[str, Any]) -> None:
        """Update the metrics an event carries figures for."""
        for key, value in event_figures(event).items():
            key = _GAUGE_OF_FIGURE.get(key, key)
            if TRAIN_METRICS.get(key, ("",))[0] == "gauge":
                self._gauges[key] = value
        kind = event.get("event")
        if kind == "start":  # each worker-group attempt starts once; the first is not a restart
            self._starts += 1
            if self._starts > 1:
                self._metrics["restarts"].inc()
        elif kind == "healed":
            self._metrics["recoveries"].inc()
        elif kind == "progress":
            self._count("tokens", event.get("window_tokens"))
            self._count("skipped_steps", event.get("window_skipped"))
            for seconds in event.get("step_times_s") or ():
                self._metrics["step_seconds"].observe(float(seconds))
        self.refresh()

    def _count(self, key: str, value: Any) -> None:
        # A Ray counter takes positive increments only; a window with nothing to add leaves it as it is.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            self._metrics[key].inc(float(value))

    def refresh(self) -> None:
        """Report every gauge's latest value again (see the class doc)."""
        for key, value in self._gauges.items():
            self._metrics[key].set(value)

    def close(self) -> None:
        """Push the run's last figures to the node's agent before the driver exits (see `flush`)."""
        self.refresh()
        flush()


# Ray's process exit pushes what was recorded since the last periodic export, bounded at 500 ms: on a
# loaded node that bound lapses and a run's last step and tokens never reach the endpoint. Ray exposes no
# Python call for the push; its C++ one is exported from the _raylet module.
_FLUSH_SYMBOL = "_ZN3ray5stats12FlushMetricsEl"  # bool ray::stats::FlushMetrics(int64_t timeout_ms)


def flush(timeout_s: float = 5.0) -> bool:
    """Export this process's Ray metrics now; False where this Ray has no such call or the push failed."""
    import ctypes

    import ray._raylet

    try:
        push = getattr(ctypes.CDLL(ray._raylet.__file__), _FLUSH_SYMBOL)
    except (OSError, AttributeError):  # another Ray build: its exit's own push is all there is
        return False
    push.restype, push.argtypes = ctypes.c_bool, [ctypes.c_int64]
    return bool(push(int(timeout_s * 1000)))
