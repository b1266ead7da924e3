"""Topology on two simulated nodes: ranks ordered by node, tensor-parallel groups node-local, and the
hierarchical compressed sync over the node ids Ray gives the workers."""

import json
import subprocess
import sys

import pytest

from cs3ray.core.mesh import Topology, TopologyError

from conftest import ROOT


@pytest.mark.slow
def test_ranks_are_node_ordered_and_tp_groups_stay_on_one_node():
    proc = subprocess.run([sys.executable, "tests/scenarios/multinode_topology.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    zones = [r["zone"] for r in rows]
    assert sorted(zones) == ["a", "a", "b", "b"]
    assert zones[0] == zones[1] and zones[2] == zones[3]  # ordered by node
    for r in rows:
        assert len(r["tp_group_nodes"]) == 1  # a TP group never spans nodes
        assert len(r["local_peers"]) == 2 and r["rank"] in r["local_peers"]
    assert [r["node_rank"] for r in rows] == [0, 0, 1, 1]
    # compression.hierarchical on Ray's placement: the two workers of a node share memory, int8 crosses nodes.
    sync = [r["hierarchical"] for r in rows]
    for s in sync:
        assert (s["nodes"], s["local_size"], s["shm"]) == (2, 2, True)
        assert s["mean_err"] <= 2 * s["scale"] / 127 and s["gloo_err"] < 1e-5
        assert s["shard_err"] <= 2 * s["scale"] / 127
        # Only the cross-node stage is sent: each rank's quarter, twice, in int8 (about 0.085 of an fp32 ring).
        assert 0.06 < s["bytes_sent"] / s["fp32_ring_bytes"] < 0.1
    assert len({s["mean_sha"] for s in sync}) == 1  # every rank holds the same bytes


def test_layouts_that_would_span_nodes_are_refused():
    Topology(0, 4, 2, ("a", "a", "b", "b")).check()
    with pytest.raises(TopologyError, match="different nodes"):
        Topology(0, 4, 4, ("a", "a", "b", "b")).check()
    with pytest.raises(TopologyError, match="not ordered by node"):
        Topology(0, 4, 2, ("a", "b", "a", "b")).check()
    with pytest.raises(TopologyError, match="does not divide"):
        Topology(0, 3, 2, ("a", "a", "a")).check()
