"""Cache counters: hits, misses and bytes per tier, bytes from L3, time workers waited for data.

Each process counts for itself and, now and then, writes its counters to
`<disk_dir>/.stats/<host>-<pid>.json` (atomically), so `cs3 cache stats` can add up every
worker of the node, and a finished run's numbers stay readable. Inside Ray the same
counters go out as Ray metrics (Prometheus) too, added up per node and run (`node_metrics`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields

from cs3ray.storage import makedirs_private, open_private

from .node_metrics import NodePublisher

STATS_DIR = ".stats"
_ADD_LOCK = threading.Lock()


@dataclass
class CacheStats:
    l1_hits: int = 0
    l1_misses: int = 0
    l1_bytes: int = 0
    l1_evictions: int = 0
    l2_hits: int = 0
    l2_misses: int = 0
    l2_bytes: int = 0
    l2_evictions: int = 0
    l2_corrupt: int = 0
    l3_reads: int = 0
    l3_bytes: int = 0
    l3_retries: int = 0
    prefetched: int = 0
    wait_s: float = 0.0

    def add(self, **delta: float) -> None:
        with _ADD_LOCK:  # prefetch threads count too; += on an attribute is not atomic
            for key, value in delta.items():
                setattr(self, key, getattr(self, key) + value)

    def hit_rate(self) -> float:
        """Share of reads that needed no fetch from L3 (prefetch fetches count against it, as they were needed)."""
        reads = self.l1_hits + self.l1_misses if self.l1_hits + self.l1_misses else self.l2_hits + self.l2_misses
        # Not (l1_hits + l2_hits) / reads: prefetch threads read L2 too, without an L1 miss of their own.
        return min(1.0, max(0.0, 1.0 - self.l3_reads / reads)) if reads else 0.0

    def minus(self, other: "CacheStats") -> "CacheStats":
        """Counters since `other` was copied (for per-epoch figures)."""
        return CacheStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "CacheStats":
        return CacheStats(**asdict(self))

    def to_dict(self) -> dict:
        return {**asdict(self), "wait_s": round(self.wait_s, 4)}


def total(stats: list[dict]) -> CacheStats:
    """The sum of several processes' counters."""
    out = CacheStats()
    names = {f.name for f in fields(out)}
    for s in stats:
        out.add(**{k: v for k, v in s.items() if k in names})
    return out


class StatsWriter:
    """Writes a process's counters under the L2 directory at most every `period_s`, and on close.

    run: the run the counters count for (the `run` tag of the node's Prometheus counters).
    """

    def __init__(self, stats: CacheStats, disk_dir: str | None, period_s: float = 2.0, run: str = "") -> None:
        self.stats, self.period_s, self._last = stats, period_s, 0.0
        self.path = (os.path.join(disk_dir, STATS_DIR, f"{socket.gethostname()}-{os.getpid()}.json")
                     if disk_dir else None)
        self._lock = threading.Lock()
        self._publisher = NodePublisher(run)

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.period_s:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """final: the process's last flush, which waits until the node's counters have it."""
        with self._lock:
            self._last = time.monotonic()
            data = self.stats.to_dict()
            try:
                self._publisher.publish(data, wait=final)
            except Exception:  # noqa: BLE001 - metrics are best effort
                pass
            if not self.path:
                return
            try:
                makedirs_private(os.path.dirname(self.path))
                tmp = f"{self.path}.tmp"
                with open_private(tmp, "w") as f:
                    json.dump({"time": time.time(), **data}, f)
                os.replace(tmp, self.path)
            except OSError:
                pass  # statistics must never stop training (a full disk, say)


def read_all(disk_dir: str) -> list[dict]:
    """Every process's last written counters under `disk_dir`."""
    folder = os.path.join(disk_dir, STATS_DIR)
    out = []
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out.append({"process": name[:-5], **json.load(f)})
            except (OSError, ValueError):
                continue
    return out
