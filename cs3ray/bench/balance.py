"""`cs3 bench balance`: a straggler rank, with and without `train.balance`, in one run and one cluster.

Two workers train the tiny preset (fp32, the same seed, data and steps). Rank 1 is the straggler,
one of two kinds (`--straggler`):

- `burn`: rank 1 is `slowdown` times slower in proportion to the rows it processes: a
  `data.transform` keeps its thread busy for (slowdown - 1) x the model's measured CPU time per
  row on every micro-batch it reads (a slower node's share of the work, not a fixed sleep per
  step, so giving it fewer rows helps as it would). The per-row cost is measured first in this
  process with one thread, as each worker runs.
- `contention`: a noisy neighbour. A CPU-bound process at the workers' niceness is pinned to the
  last core this process may use and so is rank 1 (every thread of its worker, `sched_setaffinity`, from the transform's
  first call); rank 0 gets the other cores. Rank 1's thread does the same work but waits for its core, which its CPU time
  does not show and its compute time (cs3ray.core.busy) does.

Throughput is taken over the steps after the balanced run's first re-split (two measuring windows
plus one), in both runs, and per balance window of those steps (the rounds of the speedup's
interval, cs3ray.bench.stats); `rank_utilization` is each rank's compute share of a window's wall
time, before the re-split and in the last window.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from cs3ray.config import load_config
from cs3ray.errors import UserError
from cs3ray.ops.cluster import ray_cluster

from . import stats

SLOW_RANK_ENV, SECONDS_PER_ROW_ENV = "CS3_BENCH_SLOW_RANK", "CS3_BENCH_SLOW_S_PER_ROW"
SHARED_CORE_ENV = "CS3_BENCH_SHARED_CORE"  # contention: the core rank 1 shares with the competing process
RAY_WORKER_NICENESS = 15  # Ray starts worker processes at this niceness unless RAY_worker_niceness says otherwise
STRAGGLERS = ("burn", "contention")
TRANSFORM = "cs3ray.bench.balance:slow_rows"
BASE = ["model.preset=tiny", "data.source=python-stdlib", "data.max_bytes=2000000", "train.seq_len=128",
        "train.batch_size=16", "train.lr=3e-3", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=100000",
        "train.eval_batches=1", "checkpoint.every=100000", "cluster.workers=2", "precision=fp32",
        f"data.transform={TRANSFORM}"]
# --quick: 12 steps of 32 rows read ~50 KB of text; a smaller corpus than the default run's prepares in a second.
QUICK_DATA = "data.max_bytes=400000"
TARGETS = {"balanced_speedup": 1.3, "slow_rank_utilization_after": 0.85}
ROUNDS_METHOD = (f"rounds: the balance windows after the re-split, the two runs' same steps paired (one cluster, "
                 f"the runs one after the other); {stats.METHOD}")
SEEDS_UTILIZATION = (0.68, 0.92)  # the seeds' article: utilisation before and after balancing
_pinned = False


def _pin_process(cores: set[int]) -> None:
    """Pin every thread of this process to `cores` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that has just ended
            pass


def slow_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """data.transform of the benchmark: make the slow rank a straggler of the kind the environment names."""
    global _pinned
    rank, per_row = os.environ.get(SLOW_RANK_ENV), float(os.environ.get(SECONDS_PER_ROW_ENV, "0"))
    shared = os.environ.get(SHARED_CORE_ENV)
    if rank is None or (per_row <= 0 and shared is None):
        return batch
    import ray.train

    slow = ray.train.get_context().get_world_rank() == int(rank)
    if shared is not None and not _pinned:
        core = int(shared)
        _pin_process({core} if slow else os.sched_getaffinity(0) - {core})
        _pinned = True
    if slow and per_row > 0:
        until = time.thread_time() + per_row * len(batch["tokens"])
        x = np.ones(256, dtype=np.float64)
        while time.thread_time() < until:  # CPU work, as a slower core does: counted as busy time
            x = np.sqrt(x + 1.0)
    return batch


def seconds_per_row(overrides: list[str]) -> float:
    """CPU seconds one rank's forward and backward take per row of this model, on one thread."""
    import torch

    from cs3ray.core.engine import ComputeCore
    from cs3ray.core.mesh import Topology

    cfg = load_config(None, [o for o in overrides if not o.startswith("data.transform")] + ["cluster.workers=1"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        core = ComputeCore(cfg, torch.device("cpu"), Topology(0, 1, 1, ("n0",)))
        rows = np.random.default_rng(0).integers(0, 256, (cfg.train.batch_size, cfg.train.seq_len + 1))
        core.step(lambda: rows, lr=1e-4)  # the first step allocates optimizer state
        t0 = time.thread_time()
        for _ in range(3):
            core.step(lambda: rows, lr=1e-4)
        return (time.thread_time() - t0) / (3 * cfg.train.batch_size)
    finally:
        torch.set_num_threads(threads)


def _run(root: str, name: str, overrides: list[str]) -> list[dict]:
    from cs3ray.train.driver import train

    cfg = load_config(None, overrides + [f"run.dir={os.path.join(root, name)}", f"run.name={name}"])
    events: list[dict] = []
    train(cfg, overwrite=True, quiet=True, on_event=events.append)
    return events


def _tokens_per_s(events: list[dict], after: int, until: int | None = None) -> float:
    """Tokens over time of the progress windows after step `after` (up to step `until`)."""
    windows = [e for e in events if e["event"] == "progress" and after < e["step"] <= (until or e["step"])]
    tokens = sum(e["tokens_per_s"] * e["step_time_s"] for e in windows)
    seconds = sum(e["step_time_s"] for e in windows)
    return tokens / seconds if seconds else float("nan")


def _speedup_rounds(plain: list[dict], balanced: list[dict], after: int, every: int, steps: int) -> list[float]:
    """The speedup per balance window of measured steps, the two runs' same steps paired."""
    return [_tokens_per_s(balanced, lo, lo + every) / _tokens_per_s(plain, lo, lo + every)
            for lo in range(after, steps - every + 1, every)]


def _competitor(core: int) -> subprocess.Popen:
    """A CPU-bound process pinned to `core` at the workers' niceness: the straggler's noisy neighbour, with an
    even share of the core (at nice 0 it would take 97% of it from a worker at Ray's nice 15)."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    os.sched_setaffinity(proc.pid, {core})
    os.setpriority(os.PRIO_PROCESS, proc.pid, int(os.environ.get("RAY_worker_niceness", RAY_WORKER_NICENESS)))
    return proc


def _straggler_env(straggler: str, slowdown: float, overrides: list[str],
                   log: Callable[[str], None]) -> dict[str, str]:
    """What the transform in the workers reads (they inherit the embedded cluster's environment)."""
    if straggler == "contention":
        return {SLOW_RANK_ENV: "1", SHARED_CORE_ENV: str(max(os.sched_getaffinity(0)))}
    per_row = seconds_per_row(overrides)
    log(f"the model's CPU time per row on one thread: {per_row * 1e3:.2f} ms; rank 1 slowed {slowdown:g}x")
    return {SLOW_RANK_ENV: "1", SECONDS_PER_ROW_ENV: repr((slowdown - 1) * per_row)}


def run(quick: bool = False, slowdown: float = 2.0, log: Callable[[str], None] = print,
        straggler: str = "burn") -> dict[str, Any]:
    """Both runs; the JSON-able result."""
    if straggler not in STRAGGLERS:
        raise UserError(f"--straggler must be one of {', '.join(STRAGGLERS)}; got {straggler!r}")
    if straggler == "contention" and len(os.sched_getaffinity(0)) < 2:
        raise UserError("--straggler contention needs 2 cores or more (of those this process may use): rank 0 "
                        "must keep a core to itself")
    steps, every = (12, 2) if quick else (60, 5)
    overrides = BASE + [f"train.steps={steps}", f"train.balance_every={every}"] + ([QUICK_DATA] if quick else [])
    env = _straggler_env(straggler, slowdown, overrides, log)
    # The shards both runs read, prepared in this process before the cluster starts (the runs find them cached):
    # for a corpus this small, Ray Data's pipeline would start its executor and tasks for a second of work.
    from cs3ray.train.driver import prepare_data

    prepare_data(load_config(None, overrides))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    competitor = None
    try:
        if straggler == "contention":
            log(f"rank 1 shares core {env[SHARED_CORE_ENV]} with a CPU-bound process")
            competitor = _competitor(int(env[SHARED_CORE_ENV]))
        with tempfile.TemporaryDirectory(prefix="cs3-bench-balance-") as root, \
                ray_cluster(None, num_cpus=4, quiet=True, use_recorded=False):
            log("unbalanced: train.balance=false")
            plain = _run(root, "unbalanced", overrides + ["train.balance=false"])
            log("balanced: train.balance=true")
            balanced = _run(root, "balanced", overrides + ["train.balance=true"])
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    windows = [e for e in balanced if e["event"] == "balance"]
    moved = next((e for e in windows if e["rebalanced"]), None)
    if moved is None:
        raise RuntimeError("the balanced run never re-split its batches: no persistent imbalance was measured")
    after = moved["step"] + every
    unbalanced_tps, balanced_tps = _tokens_per_s(plain, after), _tokens_per_s(balanced, after)
    figures = {**stats.summarize("balanced_speedup", _speedup_rounds(plain, balanced, after, every, steps)),
               **stats.summarize("slow_rank_utilization_after",
                                 [w["utilization"][1] for w in windows if w["step"] > moved["step"]])}
    result = {"unbalanced_tokens_per_s": unbalanced_tps, "balanced_tokens_per_s": balanced_tps, **figures,
              "straggler": straggler, "slowdown": slowdown if straggler == "burn" else None, "slow_rank": 1,
              "rank_utilization": {"before": windows[0]["utilization"], "after": windows[-1]["utilization"]},
              "seeds_utilization": {"before": SEEDS_UTILIZATION[0], "after": SEEDS_UTILIZATION[1]},
              "shares": {"before": windows[0]["shares"], "after": moved["rebalanced"]},
              "rebalanced_at_step": moved["step"], "measured_after_step": after, "steps": steps,
              "targets": TARGETS, "verdicts": stats.judge(figures, TARGETS), "method": ROUNDS_METHOD}
    log(f"re-split at step {moved['step']}: shares {result['shares']['before']} -> {result['shares']['after']}")
    return result


def title(r: dict[str, Any]) -> str:
    """The table's title: the straggler and where throughput was measured."""
    kind = (f"rank 1 {r['slowdown']:g}x slower per row" if r["straggler"] == "burn"
            else "rank 1 shares its core with a CPU-bound process")
    verdicts = "; ".join(f"{k} {stats.shown(r, k)} >= {r['targets'][k]:g}: {v}" for k, v in r["verdicts"].items())
    return f"load balancing: {kind}; measured after step {r['measured_after_step']} ({verdicts})"


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: each run's tokens/s, shares and rank utilisation, next to the seeds' utilisation."""
    u, seeds = r["rank_utilization"], r["seeds_utilization"]
    return [("unbalanced", f"{r['unbalanced_tokens_per_s']:,.0f}", str(r["shares"]["before"]),
             ", ".join(f"{x:.2f}" for x in u["before"]), f"{seeds['before']:.2f}"),
            ("balanced", f"{r['balanced_tokens_per_s']:,.0f} ({stats.shown(r, 'balanced_speedup')}x)",
             str(r["shares"]["after"]), ", ".join(f"{x:.2f}" for x in u["after"]), f"{seeds['after']:.2f}")]


COLUMNS = ["run", "tokens/s", "rows per rank", "rank utilization", "seeds' utilization"]
