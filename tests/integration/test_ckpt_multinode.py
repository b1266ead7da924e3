"""The memory tier's peer copy on 2 simulated nodes (ray.cluster_utils.Cluster): lose a node, restore from memory.

A rank on node B snapshots with the memory tier on: its chunks go to B's keeper and, as the
peer copy, to the keeper of the other node A. Node B is removed, storage loses its tensor data,
and a new rank on A still restores every tensor, from the peer copy. The Ray drivers run in
subprocesses (tests/scenarios/ckpt_peer.py), as this process may be connected to the session's head.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from helpers.cluster import simulated_nodes


@pytest.fixture(scope="module")
def two_nodes():
    with simulated_nodes(2, num_cpus=1) as cluster:
        yield cluster, cluster.head_node, next(iter(cluster.worker_nodes))


def _scenario(phase: str, cluster, run, node) -> dict:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "tests/scenarios/ckpt_peer.py", phase, cluster.address, str(run),
                           node.node_id], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _alive(cluster) -> set[str]:
    return {n["NodeID"] for n in cluster.global_state.node_table() if n["Alive"]}


@pytest.mark.slow
def test_restore_from_the_peer_copy_after_the_node_holding_the_primary_is_lost(two_nodes, tmp_path):
    cluster, node_a, node_b = two_nodes
    run = tmp_path / "run"
    saved = _scenario("save", cluster, run, node_b)
    assert saved["node"] == node_b.node_id and set(saved["keepers"]) == {node_a.node_id, node_b.node_id}

    cluster.remove_node(node_b)  # node B is lost, and the primary copy with its keeper
    deadline = time.time() + 60
    while node_b.node_id in _alive(cluster) and time.time() < deadline:
        time.sleep(0.5)
    assert _alive(cluster) == {node_a.node_id}
    shutil.rmtree(run / "chunks")  # and storage lost its tensor data: only the peer copy can restore

    got = _scenario("restore", cluster, run, node_a)
    assert (got["step"], got["source"], got["same"], got["node"]) == (7, "peer", True, node_a.node_id)
