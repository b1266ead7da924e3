"""`cs3 bench balance`: a straggler rank, with and without `train.balance`, in one run and one cluster.

Two workers train the tiny preset (fp32, the same seed, data and steps). Rank 1 is made `slowdown`
times slower in proportion to the rows it processes: a `data.transform` keeps its thread busy
for (slowdown - 1) x the model's measured CPU time per row on every micro-batch it reads (a slower
node's share of the work, not a fixed sleep per step, so giving it fewer rows helps as it would).
The per-row cost is measured first in this process with one thread, as each worker runs.
Throughput is taken over the steps after the balanced run's first re-split (two measuring windows
plus one), in both runs; `rank_utilization` is each rank's CPU-busy share of a window's wall time,
before the re-split and in the last window.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable

import numpy as np

from cs3ray.config import load_config
from cs3ray.ops.cluster import ray_cluster

SLOW_RANK_ENV, SECONDS_PER_ROW_ENV = "CS3_BENCH_SLOW_RANK", "CS3_BENCH_SLOW_S_PER_ROW"
TRANSFORM = "cs3ray.bench.balance:slow_rows"
BASE = ["model.preset=tiny", "data.source=python-stdlib", "data.max_bytes=2000000", "train.seq_len=128",
        "train.batch_size=16", "train.lr=3e-3", "train.warmup_steps=2", "train.log_every=1", "train.eval_every=100000",
        "train.eval_batches=1", "checkpoint.every=100000", "cluster.workers=2", "precision=fp32",
        f"data.transform={TRANSFORM}"]
TARGETS = {"balanced_speedup": 1.3}


def slow_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """data.transform of the benchmark: on the slowed rank, keep this thread busy for the extra time its rows cost."""
    rank, per_row = os.environ.get(SLOW_RANK_ENV), float(os.environ.get(SECONDS_PER_ROW_ENV, "0"))
    if rank is not None and per_row > 0:
        import ray.train

        if ray.train.get_context().get_world_rank() == int(rank):
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


def _tokens_per_s(events: list[dict], after: int) -> float:
    """Tokens over time of the progress windows after step `after`."""
    windows = [e for e in events if e["event"] == "progress" and e["step"] > after]
    tokens = sum(e["tokens_per_s"] * e["step_time_s"] for e in windows)
    seconds = sum(e["step_time_s"] for e in windows)
    return tokens / seconds if seconds else float("nan")


def run(quick: bool = False, slowdown: float = 2.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Both runs; the JSON-able result."""
    steps, every = (12, 2) if quick else (60, 5)
    overrides = BASE + [f"train.steps={steps}", f"train.balance_every={every}"]
    per_row = seconds_per_row(overrides)
    log(f"the model's CPU time per row on one thread: {per_row * 1e3:.2f} ms; rank 1 slowed {slowdown:g}x")
    saved = {k: os.environ.get(k) for k in (SLOW_RANK_ENV, SECONDS_PER_ROW_ENV)}
    # Read by the transform in the workers, which inherit the embedded cluster's environment.
    os.environ.update({SLOW_RANK_ENV: "1", SECONDS_PER_ROW_ENV: repr((slowdown - 1) * per_row)})
    try:
        with tempfile.TemporaryDirectory(prefix="cs3-bench-balance-") as root, \
                ray_cluster(None, num_cpus=4, quiet=True, use_recorded=False):
            log("unbalanced: train.balance=false")
            plain = _run(root, "unbalanced", overrides + ["train.balance=false"])
            log("balanced: train.balance=true")
            balanced = _run(root, "balanced", overrides + ["train.balance=true"])
    finally:
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
    result = {"unbalanced_tokens_per_s": unbalanced_tps, "balanced_tokens_per_s": balanced_tps,
              "balanced_speedup": balanced_tps / unbalanced_tps, "slowdown": slowdown, "slow_rank": 1,
              "rank_utilization": {"before": windows[0]["utilization"], "after": windows[-1]["utilization"]},
              "shares": {"before": windows[0]["shares"], "after": moved["rebalanced"]},
              "rebalanced_at_step": moved["step"], "measured_after_step": after, "steps": steps,
              "seconds_per_row": per_row}
    log(f"re-split at step {moved['step']}: shares {result['shares']['before']} -> {result['shares']['after']}")
    return result


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: each run's tokens/s, shares and rank utilisation."""
    u = r["rank_utilization"]
    return [("unbalanced", f"{r['unbalanced_tokens_per_s']:,.0f}", str(r["shares"]["before"]),
             ", ".join(f"{x:.2f}" for x in u["before"])),
            ("balanced", f"{r['balanced_tokens_per_s']:,.0f} ({r['balanced_speedup']:.2f}x)",
             str(r["shares"]["after"]), ", ".join(f"{x:.2f}" for x in u["after"]))]


COLUMNS = ["run", "tokens/s", "rows per rank", "rank utilization"]
