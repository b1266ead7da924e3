"""Preemption on 2 simulated nodes (ray.cluster_utils.Cluster): a drained node and a SIGTERM cost no step.

Each node has room for one worker (1 CPU), so the run's 2 workers span both; the second node carries a
`spot` resource, as a spot pool's nodes would. Mid-run that node is drained as an autoscaler does on a spot
reclaim (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 12`); once the
run has snapshotted the step a replacement node joins, and the drained node is removed, as the platform
would, once the group has restarted without it. In the restarted group a worker then gets SIGTERM. The run finishes, its data trace holds the exact global order
(no step lost or trained twice), and each restart names its cause: the preemption.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from unittest import mock

import pytest

from cs3ray.config import load_config

from conftest import ROOT

STEPS = 40
# The cluster runs without token auth, and every process of the test says so: Cluster's nodes, `cs3 train`
# (which joins with a token when one is at hand) and `ray drain-node`.
NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def spot_cluster():
    from ray.cluster_utils import Cluster

    # No dashboard (nothing here reads it); the GCS declares a removed node dead after 3 missed half-second
    # health checks instead of Ray's default of 5 missed 3 s ones.
    with mock.patch.dict(os.environ, NO_AUTH):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
        spot = cluster.add_node(num_cpus=1, resources={"spot": 1})
        cluster.wait_for_nodes()
    try:
        yield cluster, spot
    finally:
        for node in [*cluster.worker_nodes, cluster.head_node]:
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for(log, what, proc, timeout: float = 240) -> dict:
    """The first event of the run's log that `what` accepts; fails, with the run's stderr, when the run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = next((e for e in _events(log) if what(e)), None)
        if found is not None:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:g} s; last events: {_events(log)[-5:]}")


@pytest.mark.slow
def test_a_drained_node_and_a_sigterm_cost_no_step(spot_cluster, tmp_path):
    cluster, spot = spot_cluster
    run_dir = tmp_path / "spot"
    overrides = [f"run.dir={run_dir}", f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=1000",
                 "train.eval_batches=1", "checkpoint.every=1000", "train.batch_size=8", "precision=fp32",
                 "cache.trace=true", "cluster.max_failures=1"]
    env = dict(os.environ, **NO_AUTH)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(["cs3", "train", "configs/tiny.yaml", *overrides, "--address", cluster.address, "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "events.jsonl"
    try:
        start = _wait_for(log, lambda e: e["event"] == "start", proc)
        assert spot.node_id in start["node_ids"]  # one worker is on the spot node
        _wait_for(log, lambda e: e["event"] == "progress" and e["step"] >= 2, proc)
        drain = subprocess.run(["ray", "drain-node", "--address", cluster.address, "--node-id", spot.node_id,
                                "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim",
                                "--deadline-remaining-seconds", "12"], env=env, capture_output=True, text=True,
                               timeout=120)
        assert drain.returncode == 0, drain.stderr[-2000:]
        snap = _wait_for(log, lambda e: e["event"] == "checkpoint" and e.get("trigger") == "preemption", proc)
        with mock.patch.dict(os.environ, NO_AUTH):  # the replacement the autoscaler asked for joins
            cluster.add_node(num_cpus=1, resources={"spot": 1})
        # Ray Train restarts the group at the deadline, on the replacement: a draining node takes no new worker.
        second = _wait_for(log, lambda e: e["event"] == "start" and e["step"] == snap["step"], proc)
        assert spot.node_id not in second["node_ids"]
        cluster.remove_node(spot, allow_graceful=False)  # the platform reclaims the node
        _wait_for(log, lambda e: e["event"] == "progress" and e["step"] >= snap["step"] + 2, proc)
        os.kill(second["pids"][1], signal.SIGTERM)  # a worker process stopped with a grace period
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    events = _events(log)
    snaps = [e["step"] for e in events if e["event"] == "checkpoint" and e.get("trigger") == "preemption"]
    restored = [e["step"] for e in events if e["event"] == "restored"]
    # Each restart resumed its snapshot; the drain's restart is not one of cluster.max_failures (1, the SIGTERM's).
    assert summary["steps"] == STEPS and len(snaps) == 2 and restored == snaps
    causes = summary["restart_causes"]
    assert causes[0] == next(e for e in events if e["event"] == "restart")["cause"]
    assert causes[0].startswith(f"preemption: node {spot.node_id[:12]} drained with ")
    assert causes[1] == f"preemption: worker 1 received SIGTERM at step {snaps[1]}"
    # What the workers trained on is the global order's first STEPS batches, each once.
    from cs3ray.bench.recovery import data_audit

    cfg = load_config("configs/tiny.yaml", overrides)
    audit = data_audit(cfg, str(run_dir), STEPS)
    assert (audit["samples_repeated"], audit["samples_skipped"], audit["samples_unexpected"]) == (0, 0, 0), audit
