"""`cs3 bench train`: cs3ray's training throughput and MFU against its peers, in one run.

The peers (see plain_loop) are what a careful user would write without cs3ray: a hand-written
loop with the same model, batch, autocast precision, AdamW (foreach) and thread count, on the
same token batches, run as a plain process and inside a 1-worker Ray Train TorchTrainer. cs3ray
trains the same job with 1 worker (its cost over the plain process: `overhead_ratio`; over
Ray Train alone: `overhead_vs_ray_train`), and with 2 workers for every strategy (what sharding
costs and saves). The host's speed drifts within minutes, so the three 1-worker modes take
turns in ROUNDS rounds in one cluster (each round in another order) and every ratio is the
median of the rounds' own ratios, with its 95% interval and a verdict per target
(cs3ray.bench.stats). Every run records each step's seconds and is measured from its steady
state on (cs3ray.bench.steady: the step time no longer drifts), by one rule for every mode; the
first evaluation and the final checkpoint are outside the steps.

`--device cuda` runs the same model on a GPU: the plain loop, the Ray Train peer and cs3ray
(cluster.use_gpu) each on one GPU, every MFU against a CUDA matmul peak this process measured in
the run's compute dtype (cs3ray.core.peak); the 2-worker runs need 2 GPUs and are left out on one.

`--pipelines` measures instead 2 workers as one pipeline of 2 stages, the same global batch in
PP_MICROBATCHES micro-batches, per schedule (gpipe, 1f1b, interleaved 1f1b with 4 stages) against
ddp on the same 2 workers, the four taking turns for ROUNDS rounds: each schedule's tokens/s ratio
to ddp and its measured bubble against the schedule's theory, with intervals, and where each
stage's time went (computing, sends and receives, the rest).
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
from cs3ray.errors import UserError
from cs3ray.models import train_flops_per_token
from cs3ray.ops.cluster import ray_cluster
from cs3ray.train.driver import prepare_data, train

from . import stats
from .plain_loop import plain_loop, ray_train_peer
from .steady import DRIFT, steady_part

STRATEGIES = ("ddp", "zero1", "fsdp")
# mode -> parallel.pp_schedule on 2 ranks (the interleaved schedule: 4 stages, 2 a rank)
PIPELINES = {"pp2_gpipe": "gpipe", "pp2_1f1b": "1f1b", "pp2_interleaved_1f1b": "interleaved_1f1b"}
PP_MICROBATCHES = 8
ROUNDS = 3
ONE_WORKER_MODES = ("plain", "ray_train", "cs3ray")
PIPELINE_MODES = ("ddp", *PIPELINES)
# Every run's steps: the first FIRST are never measured (cs3ray measures its 2nd step for peak memory),
# the steady state is sought with windows of STEADY_WINDOW steps and at least LEAST steps are measured.
FIRST, STEADY_WINDOW, LEAST = 2, 2, 2
MIN_STEPS, MAX_STEPS = FIRST + 2 * STEADY_WINDOW, 30
# The steps' share of a default run's 10 minutes: the rest goes to data, peaks and each run's start
# and end in a fresh process (the larger part on 2 cores; figures: docs/benchmarks.md).
BUDGET_S = 250.0
# A 2-worker run's step against the 1-worker plain loop's on the same cores (sharding and its sync).
TWO_WORKER_STEP_COST = 1.3
# Targets of the interleaved ratios (docs/benchmarks.md); each gets a verdict from its interval.
TARGETS = {"overhead_vs_ray_train": {"at_least": 0.98}, "overhead_ratio": {"at_least": 0.97}}
PIPELINE_TARGETS = {"pp2_1f1b_vs_ddp": {"at_least": 0.85},
                    **{f"{mode}_bubble_excess": {"at_most": 0.05} for mode in PIPELINES}}


def steps_per_run(step_s: float, budget_s: float, runs: float) -> int:
    """Steps of every run that fit the budget (`runs` in 1-worker step costs): at least MIN_STEPS, at most MAX_STEPS."""
    return max(MIN_STEPS, min(MAX_STEPS, int(budget_s / (runs * step_s))))


def bubble_theoretical(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a rank in a GPipe or 1F1B step with equal stages, (p-1)/(m+p-1); with `virtual`
    stages a rank (interleaved 1F1B) the fill and drain are `virtual` times shorter: (p-1)/(v m+p-1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def cs3_run(cfg_path: str, overrides: list[str], root: str, name: str) -> dict[str, Any]:
    """A cs3ray run's summary plus `step_s`, every step's seconds on the first worker (its end event), and
    `steady_tokens_per_s`, its log windows' tokens over their time."""
    cfg = load_config(cfg_path, overrides + [f"run.dir={os.path.join(root, name)}", f"run.name={name}"])
    events: list[dict] = []
    summary = train(cfg, overwrite=True, quiet=True, on_event=events.append)
    summary["step_s"] = next(e for e in reversed(events) if e["event"] == "end")["step_s"]
    # Tokens over time of the log windows after the first, less the one whose step was measured for memory
    # (bench data's rate, from windows: it runs too few steps for the steady rule).
    progress = [e for e in events if e["event"] == "progress"]
    tokens = seconds = 0.0
    for before, window in itertools.pairwise(progress):
        if not window.get("memory_tracked"):
            n = window["tokens_seen"] - before["tokens_seen"]
            tokens, seconds = tokens + n, seconds + n / window["tokens_per_s"]
    summary["steady_tokens_per_s"] = tokens / seconds if seconds else summary["tokens_per_s"]
    return summary


def run_overrides(steps: int, device: str) -> list[str]:
    """What every cs3ray run of the bench sets: no evaluation or checkpoint inside the steps (one at the
    end); on cuda a GPU a worker (and nccl)."""
    return [f"train.steps={steps}", f"train.eval_every={steps}", "train.eval_batches=1",
            f"checkpoint.every={steps}", "checkpoint.keep=1", *(["cluster.use_gpu=true"] if device == "cuda" else [])]


class _Context:
    """What every run of one bench invocation shares: the config, its batches, threads and steps."""

    def __init__(self, config: str, quick: bool, threads: int, runs: float, log: Callable[[str], None],
                 device: str = "cpu") -> None:
        self.config, self.threads, self.log, self.device = config, threads, log, device
        self.base = load_config(config)
        self.tokens_per_step = self.base.train.batch_size * self.base.train.seq_len
        log(f"preparing data for {config}")
        shards, manifest = prepare_data(self.base)
        data = read_split(shards, manifest, "val")
        if len(data) < 2 * self.base.train.batch_size:  # tiny corpora: the train split for the peers' batches
            data = read_split(shards, manifest, "train")
        self.data = data
        self.flops_per_token = train_flops_per_token(self.base.model.args(), self.base.train.seq_len)
        self.precision = resolve_precision(self.base.precision, device)
        self.quick = quick
        self.peak = self.bench_peak(threads)
        log(f"peak {self.precision} matmul " + (f"on {device_name(device)}" if device == "cuda" else
                                                f"with {threads} threads") + f": {self.peak / 1e12:.3f} TFLOP/s")
        if quick:
            self.steps = MIN_STEPS + 4
        else:
            # A step of the same config costs many times more on some CPUs than on others: fit the
            # number of steps to what one step costs here, so the default run stays in budget.
            step_s = plain_loop(self.base, data, threads, FIRST + 1, device)[-1]
            self.steps = steps_per_run(step_s, BUDGET_S, runs)
            log(f"one step takes {step_s:.1f} s")
        log(f"{self.steps} steps a run, measured from the steady state on (at least {LEAST}, never the first {FIRST})")
        self.common = run_overrides(self.steps, device)

    def bench_peak(self, n_threads: int) -> float:
        return measure_peak(compute_dtype(self.precision), n_threads, size=1024 if self.quick else 2048,
                            seconds=0.5 if self.quick else 2.0, device=self.device)

    @property
    def two_worker_runs(self) -> bool:
        """Whether the 2-worker runs fit: always on the CPU, on cuda with 2 GPUs (a worker holds one)."""
        return self.device != "cuda" or gpu_count() >= 2

    def measured(self, step_s: list[float]) -> dict[str, Any]:
        """A run's steady part: tokens/s over it, where it starts and whether the drift criterion held."""
        part = steady_part(step_s, LEAST, first=FIRST, window=STEADY_WINDOW)
        return {"tokens_per_s": part.rate(self.tokens_per_step), "steady_from_step": part.start,
                "steady": part.steady, "step_s": [round(x, 4) for x in step_s]}

    def two_workers(self, overrides: list[str], root: str, name: str) -> dict[str, Any]:
        """A cs3ray run on 2 workers of half the threads each; windows of FIRST steps (a pipeline's bubble
        is read from the windows after the first)."""
        r = cs3_run(self.config, self.common + [
            "cluster.workers=2", f"cluster.cpus_per_worker={max(1, self.threads // 2)}", f"train.log_every={FIRST}",
            *overrides], root, name)
        mem = r.get("memory") or [{}]
        return {**self.measured(r["step_s"]), "worker_reported_mfu": r["mfu"],
                "state_bytes_per_worker": max((m.get("state_bytes") or 0) for m in mem),
                "peak_mem_bytes": mem[0].get("peak_bytes"),
                **({"bubble_fraction": r.get("bubble_fraction"), "stage_time_shares": r.get("stage_time_shares")}
                   if "pp" in r else {})}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_name(device: str) -> str | None:
    """The card a cuda run measured on (torch's name of GPU 0), None on the CPU."""
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else None


def run(config: str = "configs/small.yaml", quick: bool = False, threads: int | None = None,
        log: Callable[[str], None] = print, pipelines: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Run every mode on `device` (cpu or cuda) and return the JSON-able result (`pipelines`: the pipeline
    schedules against ddp)."""
    started = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device '{device}': use cpu or cuda.")
    if device == "cuda" and gpu_count() == 0:
        raise UserError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU visible); "
                        "use --device cpu or auto.")
    if device == "cuda" and pipelines and gpu_count() < 2:
        raise UserError(f"--pipelines --device cuda needs 2 GPUs (a stage a GPU); torch sees {gpu_count()}.")
    if quick:
        config = "configs/tiny.yaml"
    two_workers = device != "cuda" or gpu_count() >= 2  # on one GPU the 2-worker runs are left out
    runs = ROUNDS * len(PIPELINE_MODES) * TWO_WORKER_STEP_COST if pipelines else \
        ROUNDS * len(ONE_WORKER_MODES) + len(STRATEGIES) * TWO_WORKER_STEP_COST * two_workers
    ctx = _Context(config, quick, threads, runs, log, device)
    with tempfile.TemporaryDirectory(prefix="cs3-bench-train-") as root, \
            ray_cluster(None, num_cpus=threads + 4, quiet=True, use_recorded=False):
        result = _pipelines(ctx, root) if pipelines else _overhead(ctx, root)
    # The machine's speed can drift over a run (shared hosts): the peak is the best of a
    # measurement before the modes and one after, so no MFU is computed against a slow moment.
    peak = max(ctx.peak, ctx.bench_peak(threads))
    # Every MFU here is against peaks this process measured (the 2-worker runs: the peak of one
    # worker's thread count, times 2; on cuda a worker holds a GPU like the one measured, so its
    # peak). Workers measuring their own peak have come out well below this process's figure
    # on CPUs, which put their reported MFU above 1; theirs is kept beside it.
    peak_per_worker = peak if device == "cuda" else max(ctx.bench_peak(max(1, threads // 2)) for _ in range(2))
    for r in result["strategies"].values():
        r["mfu"] = mfu(r["tokens_per_s"], ctx.flops_per_token, 2, peak_per_worker)
    if not pipelines:
        result["mfu"] = mfu(result["cs3_tokens_per_s"], ctx.flops_per_token, 1, peak)
        result["baseline_mfu"] = mfu(result["baseline_tokens_per_s"], ctx.flops_per_token, 1, peak)
    return {"config": config, "device": device, "card": device_name(device), "precision": ctx.precision,
            "threads": threads, "cpu_features": cpu_features(), "pipelines": pipelines,
            "peak_flops": peak, "peak_flops_per_worker_of_2": peak_per_worker,
            "flops_per_token": ctx.flops_per_token, "rounds": ROUNDS, "steps_per_run": ctx.steps,
            "steady_rule": {"first": FIRST, "window": STEADY_WINDOW, "drift": DRIFT, "least": LEAST},
            **result, "method": stats.METHOD, "wall_s": round(time.perf_counter() - started, 1)}


def _overhead(ctx: _Context, root: str) -> dict[str, Any]:
    """The 1-worker modes in interleaved rounds, then 2 workers per strategy (one run each)."""
    one_worker = ctx.common + ["cluster.workers=1", f"cluster.cpus_per_worker={ctx.threads}",
                               f"train.batch_size={ctx.base.train.batch_size}", f"train.log_every={ctx.steps}"]
    rounds: list[dict[str, dict[str, Any]]] = []
    worker_mfu: list[float] = []
    # The 1-worker modes take turns, each round in another order, all beside the same idle
    # cluster: a drift of the host's speed reaches every mode alike over the rounds.
    for rnd in range(ROUNDS):
        this: dict[str, dict[str, Any]] = {}
        for mode in ONE_WORKER_MODES[rnd % 3:] + ONE_WORKER_MODES[:rnd % 3]:
            t0 = time.perf_counter()
            if mode == "plain":
                times = plain_loop(ctx.base, ctx.data, ctx.threads, ctx.steps, ctx.device)
            elif mode == "ray_train":
                times = ray_train_peer(ctx.base, ctx.data, ctx.threads, ctx.steps, os.path.join(root, "ray-train"),
                                       ctx.device)
            else:
                one = cs3_run(ctx.config, one_worker, root, f"one-{rnd}")
                times = one["step_s"]
                worker_mfu.append(one["mfu"])
            this[mode] = {**ctx.measured(times), "wall_s": round(time.perf_counter() - t0, 1)}
        rounds.append(this)
        ctx.log(f"round {rnd + 1}, tokens/s from step (wall s): " + ", ".join(
            f"{m} {this[m]['tokens_per_s']:,.0f} from {this[m]['steady_from_step']}"
            f"{'' if this[m]['steady'] else ' (not steady)'} ({this[m]['wall_s']:.0f})" for m in ONE_WORKER_MODES))
    strategies: dict[str, dict[str, Any]] = {}
    per_worker_batch = max(1, ctx.base.train.batch_size // 2)
    if not ctx.two_worker_runs:
        ctx.log("one GPU: the 2-worker runs are left out (each worker holds a GPU)")
    for strategy in STRATEGIES if ctx.two_worker_runs else ():
        ctx.log(f"cs3ray, 2 workers, {strategy}")
        r = strategies[strategy] = ctx.two_workers([f"train.batch_size={per_worker_batch}",
                                                    f"parallel.strategy={strategy}"], root, strategy)
        ctx.log(f"  {r['tokens_per_s']:,.0f} tokens/s, state {r['state_bytes_per_worker'] / 1e6:.1f} MB/worker")
    rate = {m: [x[m]["tokens_per_s"] for x in rounds] for m in ONE_WORKER_MODES}
    ratios = {**stats.summarize("overhead_ratio", [c / p for c, p in zip(rate["cs3ray"], rate["plain"], strict=True)]),
              **stats.summarize("overhead_vs_ray_train",
                                [c / p for c, p in zip(rate["cs3ray"], rate["ray_train"], strict=True)])}
    ddp_state = (strategies["ddp"]["state_bytes_per_worker"] or 1) if strategies else None
    return {
        "baseline_tokens_per_s": statistics.median(rate["plain"]), "baseline_runs_tokens_per_s": rate["plain"],
        "ray_train_tokens_per_s": statistics.median(rate["ray_train"]), "ray_train_runs_tokens_per_s": rate["ray_train"],
        "cs3_tokens_per_s": statistics.median(rate["cs3ray"]), "cs3_runs_tokens_per_s": rate["cs3ray"],
        "runs": rounds, **ratios, "targets": TARGETS, "verdicts": stats.judge(ratios, TARGETS),
        "worker_reported_mfu": statistics.median(worker_mfu), "strategies": strategies,
        "fsdp_state_ratio": (strategies["fsdp"]["state_bytes_per_worker"] or 0) / ddp_state if ddp_state else None,
    }


def _pipelines(ctx: _Context, root: str) -> dict[str, Any]:
    """ddp and each pipeline schedule on the same 2 workers, taking turns for ROUNDS rounds."""
    overrides = {"ddp": [f"train.batch_size={max(1, ctx.base.train.batch_size // 2)}", "parallel.strategy=ddp"]}
    for mode, schedule in PIPELINES.items():
        # One pipeline of 2 stages holds the whole global batch (ddp's 2 workers split it in 2).
        overrides[mode] = [f"train.batch_size={ctx.base.train.batch_size}", "parallel.pp=2",
                           f"parallel.pp_schedule={schedule}", f"parallel.pp_microbatches={PP_MICROBATCHES}"]
    rounds: list[dict[str, dict[str, Any]]] = []
    for rnd in range(ROUNDS):
        this = {}
        shift = rnd % len(PIPELINE_MODES)
        for mode in PIPELINE_MODES[shift:] + PIPELINE_MODES[:shift]:
            this[mode] = ctx.two_workers(overrides[mode], root, f"{mode}-{rnd}")
        rounds.append(this)
        ctx.log(f"round {rnd + 1}, tokens/s (bubble): " + ", ".join(
            f"{m} {this[m]['tokens_per_s']:,.0f}" + (f" ({this[m]['bubble_fraction']:.3f})" if m in PIPELINES else "")
            for m in PIPELINE_MODES))
    figures: dict[str, Any] = {}
    strategies: dict[str, dict[str, Any]] = {}
    for mode in PIPELINE_MODES:
        runs = [x[mode] for x in rounds]
        strategies[mode] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "worker_reported_mfu": statistics.median(r["worker_reported_mfu"] for r in runs),
            "state_bytes_per_worker": runs[-1]["state_bytes_per_worker"], "peak_mem_bytes": runs[-1]["peak_mem_bytes"],
            "runs": runs}
        if mode == "ddp":
            continue
        theory = bubble_theoretical(2, PP_MICROBATCHES, virtual_stages(PIPELINES[mode]))
        bubbles = [r["bubble_fraction"] for r in runs]
        shares = [r["stage_time_shares"] for r in runs if r["stage_time_shares"]]
        strategies[mode].update(
            bubble_fraction=statistics.median(bubbles), bubble_theoretical=theory,
            # Per stage, the median over the rounds of each share of its step time.
            stage_time_shares=[{k: statistics.median(s[stage][k] for s in shares) for k in shares[0][stage]}
                               for stage in range(len(shares[0]))] if shares else None)
        figures.update(stats.summarize(f"{mode}_vs_ddp", [r["tokens_per_s"] / x["ddp"]["tokens_per_s"]
                                                           for r, x in zip(runs, rounds, strict=True)]))
        figures.update(stats.summarize(f"{mode}_bubble_excess", [b - theory for b in bubbles], difference=True))
    return {"strategies": strategies, **figures, "targets": PIPELINE_TARGETS,
            "verdicts": stats.judge(figures, PIPELINE_TARGETS), "pp_microbatches": PP_MICROBATCHES}


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: mode, tokens/s, MFU, state MB per worker, peak MB (and a pipeline's bubble and time shares)."""
    out = []
    if not r["pipelines"]:
        out += [("plain PyTorch (peer)", round(r["baseline_tokens_per_s"]), r["baseline_mfu"], "", "", ""),
                ("plain loop in Ray Train, 1 worker (peer)", round(r["ray_train_tokens_per_s"]),
                 mfu(r["ray_train_tokens_per_s"], r["flops_per_token"], 1, r["peak_flops"]), "", "", ""),
                (f"cs3ray 1 worker (x plain {stats.shown(r, 'overhead_ratio', 3)}, x Ray Train "
                 f"{stats.shown(r, 'overhead_vs_ray_train', 3)})", round(r["cs3_tokens_per_s"]), r["mfu"], "", "", "")]
    for name, s in r["strategies"].items():
        where = ""
        if "bubble_fraction" in s:  # a pipeline: its measured idle share beside the schedule's, its ratio to ddp
            name = (f"{name} (x ddp {stats.shown(r, f'{name}_vs_ddp')}; bubble {s['bubble_fraction']:.3f}, "
                    f"theory {s['bubble_theoretical']:.3f})")
            where = " | ".join(f"{x['compute']:.2f}/{x['p2p']:.2f}/{x['other']:.2f}" for x in s["stage_time_shares"] or [])
        out.append((f"cs3ray 2 workers {name}", round(s["tokens_per_s"]), s["mfu"],
                    f"{(s['state_bytes_per_worker'] or 0) / 1e6:.1f}", f"{(s['peak_mem_bytes'] or 0) / 1e6:.1f}", where))
    return out


COLUMNS = ["mode", "tokens/s", "MFU", "state MB/worker", "peak MB", "stage time: compute/p2p/other"]
