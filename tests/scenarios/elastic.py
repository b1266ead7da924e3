"""Run by test_elastic.py in a subprocess: elastic training across simulated node loss and return.

A 3-node ray.cluster_utils.Cluster (a small head, two 2-CPU workers' nodes); each training
worker takes 2 CPUs, so there is one per node and `{min: 1, max: 2}` workers. The script
removes a node mid-run (the group shrinks to 1 worker), adds one back (it grows to 2), then
stops the run and prints the observed worker counts as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

from cs3ray.config import load_config
from cs3ray.train import train


def refresh_ray_train_view() -> None:
    """Have Ray Train's elastic policy see the nodes as they are now, rather than at the next 20 s tick
    of the coordinator it asks (Ray's own actor); without that actor the run just waits for the tick."""
    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    except ValueError:
        return
    ray.get(coordinator.get_reserved_resources.remote("cs3-elastic-scenario", recompute=True))


def main(run_dir: str) -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # No dashboard (nothing here reads it: it only takes CPU); the GCS declares a killed node dead
    # after 3 missed half-second health checks instead of Ray's default of 5 missed 3 s ones.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
    cluster.add_node(num_cpus=2)
    doomed = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    # start_timeout_s only bounds the wait for the placement group (Ray Train's worker group start
    # timeout): placement is immediate while the resources exist, and after the node loss these
    # 3 s are how long the group asks for its old size before it shrinks.
    # A small model and a checkpoint every step: what is under test is the group's size, not what it learns.
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", "train.steps=100000", "train.log_every=2", "train.eval_every=100000",
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
        "precision=fp32", "checkpoint.every=1", "cluster.workers={min: 1, max: 2}", "cluster.cpus_per_worker=2",
        "cluster.resize_interval_s=1", "cluster.start_timeout_s=3", "cluster.max_failures=5", "train.batch_size=8"])
    starts: list[dict] = []
    progress: list[dict] = []

    def on_event(e: dict) -> None:
        if e["event"] in ("start", "restored"):
            starts.append({"event": e["event"], "step": e["step"], "workers": e.get("workers"),
                           "micro_batch": e.get("micro_batch"), "grad_accum": e.get("grad_accum")})
        elif e["event"] in ("progress", "checkpoint"):
            progress.append({"event": e["event"], "step": e["step"], "starts": len(starts)})

    def trained_with(workers: int, checkpoints: int = 1, timeout: float = 300) -> None:
        """Wait until the current group has `workers` workers and has taken a checkpoint since it started."""
        deadline = time.time() + timeout
        while time.time() < deadline and runner.is_alive():
            live = [i for i, s in enumerate(starts) if s["event"] == "start"]
            if live and starts[live[-1]]["workers"] == workers:
                done = [p for p in progress if p["starts"] > live[-1] and p["event"] == "checkpoint"]
                if len(done) >= checkpoints:
                    return
            time.sleep(0.5)
        # Say what was seen: which groups started, and the last progress, so a failure can be read.
        why = "training stopped" if not runner.is_alive() else f"not within {timeout:g} s"
        raise TimeoutError(f"never trained with {workers} workers ({why}); starts: {starts}; "
                           f"last progress: {progress[-3:]}")

    stop = threading.Event()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(summary=train(cfg, on_event=on_event, quiet=True,
                                                                          stop=stop)), daemon=True)
    runner.start()
    try:
        # Ray's Cluster must be driven from the main thread; training runs in the background.
        trained_with(2)
        cluster.remove_node(doomed, allow_graceful=False)  # a node is lost: the group restarts at min size
        deadline = time.time() + 60
        while doomed.node_id in {n["NodeID"] for n in ray.nodes() if n["Alive"]} and time.time() < deadline:
            time.sleep(0.2)
        refresh_ray_train_view()
        trained_with(1)
        cluster.add_node(num_cpus=2)  # room again: the resize monitor grows the group back
        refresh_ray_train_view()
        trained_with(2)
    finally:
        stop.set()
        runner.join(timeout=300)
        ray.shutdown()
        # SIGKILL: a graceful stop of each node takes many seconds here, and nothing is left to save.
        for node in [*cluster.worker_nodes, cluster.head_node]:
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()
    summary = result.get("summary")
    print(json.dumps({"starts": starts, "summary": summary}))


if __name__ == "__main__":
    main(sys.argv[1])
