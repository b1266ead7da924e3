"""What a soak samples and how it judges growth: every Ray process's memory, descriptors and threads per node,
the object store's use and GPU memory, each series fitted with a line and extrapolated to 72 hours.

A leak is a steady slope, not a high value: start-up allocations level off, a leak keeps going. So
each series is fitted by least squares after a warm-up, and fails when its growth over 72 hours
would pass its limit (memory: 10% of the node's memory; descriptors and threads: as many again as
at the start) while the slope's 95% lower bound is above zero, i.e. the growth is real and not
the noise of a short soak extrapolated 200-fold.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

HOURS = 72.0
MEMORY_SHARE = 0.1  # of the node's memory: the most a series may grow in HOURS
WARMUP_SHARE = 0.2  # of the samples, left out of the fit
MIB = 1 << 20
# Two-sided 95% Student's t by degrees of freedom; the normal's beyond.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def _t95(df: int) -> float:
    if df <= 0:
        return math.inf
    known = [k for k in _T95 if k <= df]
    return _T95[max(known)] if df <= 30 else 1.96


def ray_processes(session: str, extra: tuple[int, ...] = ()) -> list[Any]:
    """This node's processes of the Ray session named `session` (its GCS, raylet, dashboard, monitors:
    they name the session's directory) and all their descendants (workers, agents), plus `extra` pids.
    Other Ray clusters on the same machine are left out."""
    import psutil

    procs = {p.pid: p for p in psutil.process_iter(["pid", "ppid", "cmdline"])}
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.info["ppid"], []).append(p.pid)
    todo = [pid for pid, p in procs.items() if session in " ".join(p.info["cmdline"] or [])] + list(extra)
    found: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in found or pid not in procs:
            continue
        found.add(pid)
        todo.extend(children.get(pid, []))
    return [procs[pid] for pid in sorted(found)]


def _role(p: Any) -> str:
    """A process's name for the report: its title (Ray workers: `ray::Class`), trimmed."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - it may have ended
        return "?"
    first = cmd[0] if cmd else p.name()
    if first.startswith("ray::"):
        return first.split(".")[0].split(" ")[0]
    if "dashboard" in " ".join(cmd):
        return "dashboard" if "agent" not in " ".join(cmd) else "dashboard agent"
    return os.path.basename(first) if first != "python" or len(cmd) < 2 else os.path.basename(cmd[1])


def sample_node(node: str, session: str, extra: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """One sample of every process of the Ray session on this node (and `extra` pids: a driver), and their
    totals: rss_bytes, fds, threads."""
    import psutil

    out, totals = [], {"rss_bytes": 0, "fds": 0, "threads": 0}
    for p in ray_processes(session, extra):
        try:
            with p.oneshot():
                values = {"rss_bytes": p.memory_info().rss, "fds": p.num_fds() if hasattr(p, "num_fds") else 0,
                          "threads": p.num_threads()}
            process = f"{node}:{p.pid} {_role(p)}"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for metric, value in values.items():
            out.append({"process": process, "metric": metric, "value": float(value)})
            totals[metric] += value
    for metric, value in totals.items():
        out.append({"process": f"{node}: all Ray processes", "metric": metric, "value": float(value)})
    out.extend({"process": f"{node}: GPU {i}", "metric": "gpu_bytes", "value": used} for i, used in gpu_used())
    return out


def gpu_used() -> list[tuple[int, float]]:
    """Memory in use on each GPU of this node, from nvidia-smi (no CUDA context is made); none without one."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [(int(i), float(m) * MIB) for i, m in (line.split(",") for line in text.strip().splitlines() if "," in line)]


def parse_duration(text: str) -> float:
    """Seconds of '90s', '20m', '1.5h' or a bare number of seconds; ValueError naming the text otherwise."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ValueError(f"'{text}' is not a duration: use e.g. 90s, 20m or 1h") from None
    if not value > 0:
        raise ValueError(f"'{text}' is not a positive duration")
    return value


def node_memory_bytes() -> float:
    import psutil

    return float(psutil.virtual_memory().total)


@dataclass(frozen=True)
class Fit:
    process: str
    metric: str
    samples: int
    start: float
    slope_per_hour: float
    slope_per_hour_interval: tuple[float, float]
    projected_72h: float  # the growth the slope gives over 72 hours
    limit: float
    failed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit(times_s: list[float], values: list[float]) -> tuple[float, float, float]:
    """Least-squares slope per hour of `values` over `times_s` and its 95% interval (t on the slope's error)."""
    n = len(times_s)
    if n < 2:
        return 0.0, -math.inf, math.inf
    hours = [t / 3600.0 for t in times_s]
    mx, my = sum(hours) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in hours)
    if sxx == 0:
        return 0.0, -math.inf, math.inf
    slope = sum((x - mx) * (y - my) for x, y in zip(hours, values, strict=True)) / sxx
    if n < 3:
        return slope, -math.inf, math.inf
    resid = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(hours, values, strict=True))
    half = _t95(n - 2) * math.sqrt(resid / (n - 2) / sxx)
    return slope, slope - half, slope + half


def judge(process: str, metric: str, times_s: list[float], values: list[float], memory_bytes: float) -> Fit:
    """A series' fit after its own warm-up (a process started mid-soak has one too), and whether its
    72-hour growth passes its limit for real."""
    skip = max(1, int(len(values) * WARMUP_SHARE))
    t, v = times_s[skip:], values[skip:]
    slope, low, high = fit(t, v)
    limit = memory_bytes * MEMORY_SHARE if metric.endswith("bytes") else max(values[0], 1.0)
    projected = slope * HOURS
    return Fit(process, metric, len(v), values[0], slope, (low, high), projected, limit,
               failed=projected > limit and low > 0)


def judge_all(samples: list[tuple[float, list[dict[str, Any]]]], memory_bytes: dict[str, float],
              least: int = 5) -> list[Fit]:
    """Every series in `samples` ((seconds since start, one sample_node() result per node, concatenated));
    series seen fewer than `least` times (a process that came and went late) are left out."""
    series: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for when, rows in samples:
        for row in rows:
            t, v = series.setdefault((row["process"], row["metric"]), ([], []))
            t.append(when)
            v.append(row["value"])
    fits = []
    for (process, metric), (t, v) in sorted(series.items()):
        if len(v) >= least:
            node = process.split(":", 1)[0]
            fits.append(judge(process, metric, t, v, memory_bytes.get(node, max(memory_bytes.values(), default=0))))
    return fits
