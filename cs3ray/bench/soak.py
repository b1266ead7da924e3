"""`cs3 validate --soak DURATION`: the cluster under a steady mix of work for DURATION, every Ray process sampled.

The work is what a production cluster does: a training run that checkpoints every CHECKPOINT_EVERY
steps and has one of its workers killed (SIGKILL) a third of the way in (after its first checkpoint), and, from its first
checkpoint, a served model under a steady open-loop load. Each INTERVAL every node reports its Ray
processes' RSS, open descriptors and threads (and GPU memory), the driver the object store's use;
cs3ray.ops.soak fits each series and fails those that would pass their limit in 72 hours.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from typing import Any, Callable

from cs3ray.config import load_config
from cs3ray.ops.cluster import ray_cluster
from cs3ray.ops.ports import free_port
from cs3ray.ops.soak import judge_all

CHECKPOINT_EVERY = 20
LOAD_RATE = 2.0  # requests a second, each 16-32 tokens out
KILL_TIMEOUT_S = 180.0  # at least this long for each stage of the killed worker's recovery (a loaded host is slow)


def _sampler_class():
    import ray

    @ray.remote(num_cpus=0)
    class NodeSampler:
        """Samples the Ray processes of the node it runs on."""

        def __init__(self, node: str, driver: tuple[int, ...]) -> None:
            self.node, self.driver = node, driver
            self.session = os.path.basename(ray._private.worker.global_worker.node.get_session_dir_path())

        def sample(self) -> list[dict[str, Any]]:
            from cs3ray.ops.soak import sample_node

            return sample_node(self.node, self.session, self.driver)

        def memory(self) -> float:
            from cs3ray.ops.soak import node_memory_bytes

            return node_memory_bytes()

    return NodeSampler


def _object_store_row() -> dict[str, Any]:
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0.0)
    free = ray.available_resources().get("object_store_memory", 0.0)
    return {"process": "cluster: object store", "metric": "object_store_bytes", "value": float(total - free)}


def _serve_load(run_dir: str, done: threading.Event, counts: dict[str, int]) -> None:
    """Serve the run's checkpoint and replay requests at LOAD_RATE until `done`."""
    from cs3ray.serve.deploy import deploy, make_spec, shutdown

    from .serve_load import replay, workload

    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    spec = make_spec(run_dir, name="cs3-soak", overrides={"max_batch": 8})
    url = deploy(spec, "127.0.0.1", free_port())
    try:
        seed = 0
        # One replay at least: on a slow host the deployment can come up after the rest of the work has ended.
        while seed == 0 or not done.is_set():
            rep = replay(url, spec.name, workload(8, rate=LOAD_RATE, seed=seed, output_tokens=(16, 32)))
            counts["requests"] += len(rep.results)
            counts["errors"] += sum(1 for r in rep.results if not r.ok)
            seed += 1
    finally:
        shutdown(spec.name)


def run(duration_s: float, interval_s: float = 60.0, address: str | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """The soak on the cluster at `address` (default: an embedded one); the JSON-able result."""
    import ray

    from cs3ray.train.driver import train

    from .recovery import in_thread, joined, kill_once

    samples: list[tuple[float, list[dict[str, Any]]]] = []
    counts = {"requests": 0, "errors": 0}
    with tempfile.TemporaryDirectory(prefix="cs3-soak-") as root, \
            ray_cluster(address, num_cpus=None if address else 8, quiet=True, use_recorded=True):
        nodes = [n for n in ray.nodes() if n["Alive"]]
        Sampler = _sampler_class()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = ray.get_runtime_context().get_node_id()
        # The driver (this process) is sampled by its own node's sampler.
        samplers = {n["NodeID"][:8]: Sampler.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(n["NodeID"][:8], (os.getpid(),) if n["NodeID"] == here else ())
            for n in nodes}
        memory = dict(zip(samplers, ray.get([s.memory.remote() for s in samplers.values()]), strict=True))
        run_dir = os.path.join(root, "run")
        cfg = load_config(None, [
            "model.preset=tiny", "data.source=python-stdlib", "train.seq_len=128", "train.warmup_steps=2",
            f"run.dir={run_dir}", "run.name=cs3-soak", "train.steps=100000000", f"checkpoint.every={CHECKPOINT_EVERY}",
            "checkpoint.keep=2", "train.log_every=5", "train.eval_every=100000000", "train.eval_batches=1",
            "train.batch_size=8", "cluster.workers=2", "cluster.max_failures=3", "data.max_bytes=400000"])
        seen: list[dict] = []
        stop, done = threading.Event(), threading.Event()
        trainer, trained = in_thread(lambda: train(cfg, on_event=seen.append, quiet=True, stop=stop))
        loader: tuple[threading.Thread, dict] | None = None
        killer: tuple[threading.Thread, dict] | None = None
        log(f"soak of {duration_s:.0f} s on {len(nodes)} node(s): training (a checkpoint every {CHECKPOINT_EVERY} "
            f"steps, one worker killed), serving {LOAD_RATE:g} requests/s, sampling every {interval_s:.0f} s")
        started = time.monotonic()
        try:
            while (elapsed := time.monotonic() - started) < duration_s:
                if "error" in trained:
                    raise trained["error"]
                rows = [row for part in ray.get([s.sample.remote() for s in samplers.values()]) for row in part]
                samples.append((elapsed, rows + [_object_store_row()]))
                if loader is None and any(e["event"] == "checkpoint" for e in list(seen)):
                    loader = in_thread(lambda: _serve_load(run_dir, done, counts))
                # The kill waits for a checkpoint so that the restarted group restores one (a slow host may
                # not have reached the first checkpoint a third of the way into a short soak).
                if killer is None and elapsed >= duration_s / 3 and any(e["event"] == "checkpoint" for e in list(seen)):
                    step = max((e["step"] for e in list(seen) if e["event"] == "progress"), default=0)
                    killer = in_thread(lambda step=step: kill_once(lambda: list(seen), step, max(KILL_TIMEOUT_S, duration_s)))
                time.sleep(max(0.0, interval_s - (time.monotonic() - started - elapsed)))
        finally:
            if killer is not None:  # the killed worker's recovery is part of the work: seen before the run is stopped
                killer[0].join(timeout=600)
            stop.set()  # the run checkpoints and ends; the load stops after its current replay
            done.set()
            for part in (loader, killer):
                if part is not None:
                    part[0].join(timeout=600)
            for sampler in samplers.values():
                ray.kill(sampler)
        summary = joined(trainer, trained, 600, "the soak's training run")
        for part in (killer, loader):
            if part is not None and "error" in part[1]:
                raise part[1]["error"]
    fits = judge_all(samples, {**memory, "cluster": max(memory.values(), default=0.0)})
    failed = [f.to_dict() for f in fits if f.failed]
    return {"duration_s": duration_s, "interval_s": interval_s, "samples": len(samples),
            "training_steps": summary.get("steps"), "restarts": summary.get("restarts"),
            "checkpoints": sum(1 for e in seen if e["event"] == "checkpoint"), **counts,
            "soak": {"series": [f.to_dict() for f in fits], "failed": failed}, "passed": not failed,
            "rule": "least-squares slope after the first 20% of samples, x 72 h; fails when above its limit "
                    "(memory: 10% of the node's; descriptors, threads: their starting count) with the slope's "
                    "95% lower bound above 0"}


def _shown(metric: str, value: float) -> str:
    return f"{value / (1 << 20):,.1f} MiB" if metric.endswith("bytes") else f"{value:,.1f}"


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: the failed series first, then the aggregates (per node, object store, GPUs)."""
    series = r["soak"]["series"]
    shown = [s for s in series if s["failed"]] + [s for s in series if not s["failed"] and ":" in s["process"]
                                                   and not s["process"].split(":", 1)[1].strip()[0].isdigit()]
    return [(s["process"], s["metric"], s["samples"], _shown(s["metric"], s["start"]),
             _shown(s["metric"], s["slope_per_hour"]), _shown(s["metric"], s["projected_72h"]),
             _shown(s["metric"], s["limit"]), "FAIL" if s["failed"] else "ok") for s in shown]


COLUMNS = ["process", "metric", "samples", "start", "slope per hour", "in 72 h", "limit", "result"]
