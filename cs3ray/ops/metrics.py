"""Run metrics: the figures a run's events carry, as Ray metrics (Prometheus) for live dashboards.

The events themselves go to the run's JSONL log (cs3ray.ops.events).
"""

from __future__ import annotations

import math
from typing import Any

# Prometheus names get Ray's "ray_" prefix on the metrics endpoint (counters also "_total").
TRAIN_GAUGES: dict[str, str] = {
    "loss": "training loss (mean over ranks, last step of the log window)",
    "val_loss": "validation loss",
    "tokens_per_s": "global tokens per second over the log window",
    "step_time_s": "seconds of the last optimizer step",
    "step": "optimizer step",
    "lr": "learning rate",
    "mfu": "model FLOPs utilisation (0-1)",
    "grad_norm": "global gradient norm before clipping (runs with train.clip > 0)",
    "loss_scale": "fp16 loss scale",
    "skipped_steps": "steps skipped for an inf/nan gradient so far",
    "workers": "workers taking part in the step",
    "comm_bytes_per_step": "gradient bytes a rank sent per step (compressed sync only)",
    "wire_ratio": "gradient bytes sent / an fp32 ring all-reduce's (compressed sync only)",
    "checkpoint_save_s": "seconds the last checkpoint blocked training",
    "checkpoint_restore_s": "seconds the last restore took (a resume, retry or resize)",
    "restarts": "times the worker group started again from a checkpoint in this run (retries, resizes)",
    "recoveries": "replicas that healed from a live peer without a restart (cluster.fault_tolerance=replicas)",
}
# Event fields that are figures under their own name.
_COPIED = {"progress": ("loss", "tokens_per_s", "step_time_s", "step", "lr", "mfu", "grad_norm", "loss_scale",
                        "skipped_steps", "workers", "comm_bytes_per_step", "wire_ratio"),
           "eval": ("val_loss",)}


def event_figures(event: dict[str, Any]) -> dict[str, float]:
    """The figures an event carries, by TRAIN_GAUGES name (what the gauges and the optional loggers record)."""
    kind = event.get("event")
    out = {key: event.get(key) for key in _COPIED.get(kind, ())}
    if kind == "checkpoint":
        out["checkpoint_save_s"] = event.get("seconds")
    elif kind == "restored":
        out["checkpoint_restore_s"] = event.get("seconds")
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class RunMetrics:
    """A run's Prometheus gauges, set by the driver from the events its workers report.

    The driver sees every event of every worker-group attempt, so restarts and recoveries are
    counted where they are observed. Ray's metrics agent drops a gauge value not reported again
    within two report intervals, so `refresh` re-sets every value at each of the driver's polls
    (a restore's seconds, set once, would otherwise vanish); they leave the endpoint that long
    after the driver exits, as a finished run's should.
    """

    def __init__(self, run_name: str) -> None:
        from ray.util.metrics import Gauge

        self._gauges = {}
        for key, desc in TRAIN_GAUGES.items():
            g = Gauge(f"cs3_train_{key}", description=desc, tag_keys=("run",))
            g.set_default_tags({"run": run_name})
            self._gauges[key] = g
        self._starts = 0
        self._recoveries = 0
        self._values: dict[str, float] = {"restarts": 0.0, "recoveries": 0.0}
        self.refresh()

    def observe(self, event: dict[str, Any]) -> None:
        """Update the gauges an event carries figures for."""
        self._values.update(event_figures(event))
        kind = event.get("event")
        if kind == "start":  # each worker-group attempt starts once; the first is not a restart
            self._starts += 1
            self._values["restarts"] = float(self._starts - 1)
        elif kind == "healed":
            self._recoveries += 1
            self._values["recoveries"] = float(self._recoveries)
        self.refresh()

    def refresh(self) -> None:
        """Report every gauge's latest value again (see the class doc)."""
        for key, value in self._values.items():
            self._gauges[key].set(value)
