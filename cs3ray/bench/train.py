"""`cs3 bench train`: cs3ray's training throughput and MFU against its peers, in one run.

The peers (see plain_loop) are what a careful user would write without cs3ray: a hand-written
loop with the same model, batch, autocast precision, AdamW (foreach) and thread count, on the
same token batches, run as a plain process and inside a 1-worker Ray Train TorchTrainer. cs3ray
trains the same job with 1 worker (its cost over the plain process: `overhead_ratio`; over
Ray Train alone: `overhead_vs_ray_train`), and with 2 workers for every strategy (what sharding
costs and saves). The host's speed drifts within minutes, so the three 1-worker modes take
turns in ROUNDS rounds in one cluster (each round in another order) and every ratio is the
median of the rounds' own ratios, with its 95% interval and a verdict per target (cs3ray.bench.stats). Steady-state rates only: the first steps (warm-up,
allocation) are left out of every measurement. The pipeline modes split the model into 2 stages
(one per worker) and the same global batch into PP_MICROBATCHES micro-batches, one run per schedule.
"""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import time
from typing import Any, Callable

from cs3ray.config import load_config
from cs3ray.core.mfu import mfu
from cs3ray.core.peak import cpu_features, measure_peak
from cs3ray.core.pipeline import virtual_stages
from cs3ray.core.precision import compute_dtype, resolve_precision
from cs3ray.data.shards import read_split
from cs3ray.models import train_flops_per_token
from cs3ray.ops.cluster import ray_cluster
from cs3ray.train.driver import prepare_data, train

from . import stats
from .plain_loop import plain_loop, ray_train_peer

STRATEGIES = ("ddp", "zero1", "fsdp")
# mode -> parallel.pp_schedule on 2 ranks (the interleaved schedule: 4 stages, 2 a rank)
PIPELINES = {"pp2_gpipe": "gpipe", "pp2_1f1b": "1f1b", "pp2_interleaved_1f1b": "interleaved_1f1b"}
PP_MICROBATCHES = 8
# The measured and warm-up steps' share of the default run's 10 minutes: the rest goes to data,
# peaks, each cs3ray and Ray Train run's start (the larger part on 2 cores), the slow first
# steps of each fresh process, evals, final checkpoints and each cs3ray run's memory-tracked step.
BUDGET_S = 160.0
ROUNDS = 3
ONE_WORKER_MODES = ("plain", "ray_train", "cs3ray")
# The 1-worker modes every round, 2 workers per strategy and per pipeline schedule.
MODES = ROUNDS * len(ONE_WORKER_MODES) + len(STRATEGIES) + len(PIPELINES)
# Targets of the interleaved 1-worker ratios (docs/benchmarks.md); each gets a verdict from its interval.
TARGETS = {"overhead_vs_ray_train": 0.98, "overhead_ratio": 0.97}


def steps_for_budget(step_s: float, budget_s: float, modes: int, most: tuple[int, int] = (3, 15)) -> tuple[int, int]:
    """(warm-up, measured) steps per mode that fit the budget: at least 1 + 2, at most `most`."""
    per_mode = max(3, int(budget_s / (modes * step_s)))
    warmup = min(most[0], max(1, per_mode // 5))
    return warmup, max(2, min(most[1], per_mode - warmup))


def bubble_theoretical(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a rank in a GPipe or 1F1B step with equal stages, (p-1)/(m+p-1); with `virtual`
    stages a rank (interleaved 1F1B) the fill and drain are `virtual` times shorter: (p-1)/(v m+p-1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def cs3_run(cfg_path: str, overrides: list[str], root: str, name: str) -> dict[str, Any]:
    """A cs3ray run's summary plus `steady_tokens_per_s`: its steady windows' tokens over their time.

    That is how the peers' rate is computed (the summary's own figure is the mean of the
    windows' rates, which a noisy window moves more); the windows are the summary's: all but
    the first and the one whose step was measured for memory.
    """
    cfg = load_config(cfg_path, overrides + [f"run.dir={os.path.join(root, name)}", f"run.name={name}"])
    events: list[dict] = []
    summary = train(cfg, overwrite=True, quiet=True, on_event=events.append)
    progress = [e for e in events if e["event"] == "progress"]
    tokens = seconds = 0.0
    for before, window in itertools.pairwise(progress):
        if not window.get("memory_tracked"):
            n = window["tokens_seen"] - before["tokens_seen"]
            tokens, seconds = tokens + n, seconds + n / window["tokens_per_s"]
    summary["steady_tokens_per_s"] = tokens / seconds if seconds else summary["tokens_per_s"]
    summary["window_step_s"] = [round(w["step_time_s"], 4) for w in progress]
    return summary


def run(config: str = "configs/small.yaml", quick: bool = False, threads: int | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every mode and return the JSON-able result."""
    started = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    if quick:
        config, warmup, steps = "configs/tiny.yaml", 2, 4
    else:
        warmup, steps = 3, 15
    base = load_config(config)
    tokens_per_step = base.train.batch_size * base.train.seq_len
    batch = base.train.batch_size
    per_worker_batch = max(1, batch // 2)
    log(f"preparing data for {config}")
    shards, manifest = prepare_data(base)
    data = read_split(shards, manifest, "val")
    if len(data) < 2 * batch:  # tiny corpora: fall back to the train split for the peer's batches
        data = read_split(shards, manifest, "train")
    flops_per_token = train_flops_per_token(base.model.args(), base.train.seq_len)
    precision = resolve_precision(base.precision, "cpu")

    def bench_peak(n_threads: int) -> float:
        return measure_peak(compute_dtype(precision), n_threads, size=1024 if quick else 2048,
                            seconds=0.5 if quick else 2.0)
    peak = bench_peak(threads)
    log(f"peak {precision} matmul with {threads} threads: {peak / 1e12:.3f} TFLOP/s")

    if not quick:
        # A step of the same config costs many times more on some CPUs than on others: fit the
        # number of steps to what one step costs here, so the default run stays in budget
        # (figures: docs/benchmarks.md).
        step_s = tokens_per_step / plain_loop(base, data, threads, 2, 1)  # a steady step (the 3rd)
        warmup, steps = steps_for_budget(step_s, BUDGET_S, MODES)
        log(f"one step takes {step_s:.1f} s")
    # Every cs3ray run: same steps, one log window for warm-up, no evals or checkpoints in the way.
    # A run's 2nd step is measured for peak memory (much slower) and left out of its rate with
    # the first log window; with 1 warm-up step it is a window of its own, so add a step for it.
    total = warmup + steps + (1 if warmup < 2 else 0)
    # The peers leave out as many first steps as cs3ray's rate does: a fresh process's first
    # steps are slower, so fewer left out would slow the peers down.
    peer_warmup = total - steps
    log(f"{peer_warmup} warm-up + {steps} measured steps per mode, {ROUNDS} rounds of the 1-worker modes")
    common = [f"train.steps={total}", f"train.log_every={warmup}" if warmup else "train.log_every=1",
              f"train.eval_every={total}", "train.eval_batches=1", f"checkpoint.every={total}", "checkpoint.keep=1"]
    one_worker = common + ["cluster.workers=1", f"cluster.cpus_per_worker={threads}", f"train.batch_size={batch}"]
    results: dict[str, Any] = {}
    rounds: list[dict[str, float]] = []
    # Per round and 1-worker mode: the peers' every step, cs3ray's mean step per log window (warm-up included).
    step_times: list[dict[str, list[float]]] = []
    worker_mfu: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cs3-bench-train-") as root, \
            ray_cluster(None, num_cpus=threads + 4, quiet=True, use_recorded=False):
        # The 1-worker modes take turns, each round in another order, all beside the same idle
        # cluster: a drift of the host's speed reaches every mode alike over the rounds.
        for rnd in range(ROUNDS):
            rates: dict[str, float] = {}
            walls: dict[str, float] = {}
            times: dict[str, list[float]] = {mode: [] for mode in ONE_WORKER_MODES}
            for mode in ONE_WORKER_MODES[rnd % 3:] + ONE_WORKER_MODES[:rnd % 3]:
                t0 = time.perf_counter()
                if mode == "plain":
                    rates[mode] = plain_loop(base, data, threads, peer_warmup, steps, times[mode])
                elif mode == "ray_train":
                    rates[mode] = ray_train_peer(base, data, threads, peer_warmup, steps,
                                                 os.path.join(root, "ray-train"), times[mode])
                else:
                    one = cs3_run(config, one_worker, root, f"one-{rnd}")
                    rates[mode] = one["steady_tokens_per_s"]
                    times[mode] = one["window_step_s"]
                    worker_mfu.append(one["mfu"])
                walls[mode] = time.perf_counter() - t0
            rounds.append(rates)
            step_times.append(times)
            log(f"round {rnd + 1}, tokens/s (wall s): " + ", ".join(
                f"{m} {rates[m]:,.0f} ({walls[m]:.0f})" for m in ONE_WORKER_MODES))
        for strategy in STRATEGIES:
            log(f"cs3ray, 2 workers, {strategy}")
            r = cs3_run(config, common + ["cluster.workers=2", f"cluster.cpus_per_worker={max(1, threads // 2)}",
                                           f"train.batch_size={per_worker_batch}", f"parallel.strategy={strategy}"],
                         root, strategy)
            mem = (r.get("memory") or [{}])[0]
            results[strategy] = {"tokens_per_s": r["steady_tokens_per_s"], "worker_reported_mfu": r["mfu"],
                                 "state_bytes_per_worker": mem.get("state_bytes"),
                                 "peak_mem_bytes": mem.get("peak_bytes")}
            log(f"  {r['steady_tokens_per_s']:,.0f} tokens/s, state {mem.get('state_bytes', 0) / 1e6:.1f} MB/worker")
        for mode, schedule in PIPELINES.items():
            # One pipeline of 2 stages holds the whole global batch (the 2-worker strategies split it in 2).
            theory = bubble_theoretical(2, PP_MICROBATCHES, virtual_stages(schedule))
            log(f"cs3ray, 2 workers, pipeline of 2 ranks, {schedule}, {PP_MICROBATCHES} micro-batches")
            r = cs3_run(config, common + ["cluster.workers=2", f"cluster.cpus_per_worker={max(1, threads // 2)}",
                                           f"train.batch_size={batch}", "parallel.pp=2",
                                           f"parallel.pp_schedule={schedule}",
                                           f"parallel.pp_microbatches={PP_MICROBATCHES}"], root, mode)
            mem = (r.get("memory") or [{}])[0]
            results[mode] = {"tokens_per_s": r["steady_tokens_per_s"], "worker_reported_mfu": r["mfu"],
                             "state_bytes_per_worker": max((m.get("state_bytes") or 0) for m in r.get("memory") or [{}]),
                             "peak_mem_bytes": mem.get("peak_bytes"), "bubble_fraction": r.get("bubble_fraction"),
                             "bubble_theoretical": theory}
            log(f"  {r['steady_tokens_per_s']:,.0f} tokens/s, bubble {r.get('bubble_fraction')} (theory {theory:.3f})")

    def median(values) -> float:
        return float(statistics.median(values))
    baseline, ray_train_rate, cs3_rate = (median(x[m] for x in rounds) for m in ONE_WORKER_MODES)
    # The machine's speed can drift over a run (shared hosts): the peak is the best of a
    # measurement before the modes and one after, so no MFU is computed against a slow moment.
    peak = max(peak, bench_peak(threads))
    # Every MFU here is against peaks this process measured (the 2-worker runs: the peak of one
    # worker's thread count, times 2). Workers measuring their own peak have come out well below
    # this process's figure, which put their reported MFU above 1; theirs is kept beside it.
    peak_per_worker = max(bench_peak(max(1, threads // 2)) for _ in range(2))
    for r in results.values():
        r["mfu"] = mfu(r["tokens_per_s"], flops_per_token, 2, peak_per_worker)
    ddp_state = results["ddp"]["state_bytes_per_worker"] or 1
    ratios = {**stats.summarize("overhead_ratio", [x["cs3ray"] / x["plain"] for x in rounds]),
              **stats.summarize("overhead_vs_ray_train", [x["cs3ray"] / x["ray_train"] for x in rounds])}
    return {
        "config": config, "threads": threads, "cpu_features": cpu_features(), "step_s": step_times,
        "peak_flops": peak, "peak_flops_per_worker_of_2": peak_per_worker,
        "flops_per_token": flops_per_token, "rounds": len(rounds),
        "baseline_tokens_per_s": baseline, "baseline_runs_tokens_per_s": [x["plain"] for x in rounds],
        "baseline_mfu": mfu(baseline, flops_per_token, 1, peak),
        "ray_train_tokens_per_s": ray_train_rate, "ray_train_runs_tokens_per_s": [x["ray_train"] for x in rounds],
        "cs3_tokens_per_s": cs3_rate, "cs3_runs_tokens_per_s": [x["cs3ray"] for x in rounds],
        **ratios, "targets": TARGETS, "verdicts": stats.judge(ratios, TARGETS), "method": stats.METHOD,
        "mfu": mfu(cs3_rate, flops_per_token, 1, peak), "worker_reported_mfu": median(worker_mfu),
        "strategies": results,
        "fsdp_state_ratio": (results["fsdp"]["state_bytes_per_worker"] or 0) / ddp_state,
        **{f"{mode}_vs_ddp": results[mode]["tokens_per_s"] / (results["ddp"]["tokens_per_s"] or 1)
           for mode in ("pp2_1f1b", "pp2_interleaved_1f1b")},
        "warmup_steps": peer_warmup, "steps_measured": steps, "wall_s": round(time.perf_counter() - started, 1),
    }


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: mode, tokens/s, MFU, state MB per worker, peak MB."""
    out = [("plain PyTorch (peer)", r["baseline_tokens_per_s"], r["baseline_mfu"], "", ""),
           ("plain loop in Ray Train, 1 worker (peer)", r["ray_train_tokens_per_s"],
            mfu(r["ray_train_tokens_per_s"], r["flops_per_token"], 1, r["peak_flops"]), "", ""),
           ("cs3ray 1 worker", r["cs3_tokens_per_s"], r["mfu"], "", "")]
    for name, s in r["strategies"].items():
        if "bubble_fraction" in s:  # a pipeline: its measured idle share beside the schedule's
            bubble = "?" if s["bubble_fraction"] is None else f"{s['bubble_fraction']:.3f}"
            name = f"{name} (bubble {bubble}, theory {s['bubble_theoretical']:.3f})"
        out.append((f"cs3ray 2 workers {name}", s["tokens_per_s"], s["mfu"],
                    f"{(s['state_bytes_per_worker'] or 0) / 1e6:.1f}", f"{(s['peak_mem_bytes'] or 0) / 1e6:.1f}"))
    return out
