"""cluster.placement and cluster.label_selector on two simulated labelled nodes (zone=a, zone=b): a selector puts
every worker on the labelled node, spread uses both nodes; what no node can satisfy is one line
before anything starts; a spread tensor-parallel layout is refused by the config."""

from __future__ import annotations

import json
import os

import pytest

from cs3ray.config import load_config
from cs3ray.errors import UserError
from cs3ray.train.placement import check_placement

from conftest import ROOT, run_cs3
from helpers.cluster import simulated_nodes

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.steps=1", "train.warmup_steps=0", "train.eval_every=1", "train.eval_batches=1",
         "checkpoint.every=1", "cluster.workers=2", "data.max_bytes=100000", "precision=fp32"]


@pytest.fixture(scope="module")
def zones():
    with simulated_nodes(2, num_cpus=2, labels=[{"zone": "a"}, {"zone": "b"}]) as cluster:
        nodes = [cluster.head_node, *cluster.worker_nodes]
        yield cluster.address, {n.node_id: zone for n, zone in zip(nodes, "ab", strict=True)}


def train(address: str, run_dir, *overrides: str):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    return run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", *SMALL, *overrides, "--address", address],
                   env=env, cwd=ROOT, timeout=300)


def worker_zones(run_dir, zone_of: dict[str, str]) -> list[str]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    return [zone_of[n] for n in start["node_ids"]]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, expected", [
    (["cluster.label_selector.zone=b"], ["b", "b"]),
    (["cluster.placement=spread"], ["a", "b"]),
])
def test_workers_go_where_placement_and_labels_say(zones, tmp_path, overrides, expected):
    address, zone_of = zones
    proc = train(address, tmp_path / "run", *overrides)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert sorted(worker_zones(tmp_path / "run", zone_of)) == expected  # which node holds rank 0 is Ray's choice


@pytest.mark.slow
def test_a_selector_no_node_matches_is_one_line_before_anything_starts(zones, tmp_path):
    proc = train(zones[0], tmp_path / "run", "cluster.label_selector.zone=c")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "no node of the cluster has the labels cluster.label_selector asks for (zone=c)" in errors[0]
    assert "zone=a" in errors[0] and "zone=b" in errors[0]
    assert not (tmp_path / "run" / "events.jsonl").exists()


def node(cpus: float, **labels: str) -> dict:
    return {"Alive": True, "Resources": {"CPU": cpus}, "Labels": {"ray.io/node-id": "x", **labels}}


def test_strict_strategies_the_cluster_cannot_meet_are_refused():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["cluster.workers=4", "cluster.placement=strict_pack"])
    with pytest.raises(UserError, match="strict_pack puts all 4 workers on one node, and no node has room"):
        check_placement(cfg, [node(2, zone="a"), node(2, zone="b")])
    check_placement(cfg, [node(4), node(1)])
    cfg = load_config(ROOT / "configs/tiny.yaml", ["cluster.workers=3", "cluster.placement=strict_spread"])
    with pytest.raises(UserError, match="each of the 3 workers on its own node, and only 2 node"):
        check_placement(cfg, [node(8), node(8)])
    # Ray's operators are Ray's to evaluate.
    check_placement(load_config(ROOT / "configs/tiny.yaml", ["cluster.label_selector.zone=!a"]), [node(2, zone="a")])


def test_config_refuses_spread_tensor_parallel_groups_and_empty_labels():
    with pytest.raises(UserError, match="scatters workers over nodes, but a parallel.tp=2 group must stay on one node"):
        load_config(ROOT / "configs/tiny.yaml", ["cluster.workers=4", "parallel.tp=2", "parallel.strategy=fsdp",
                                                 "cluster.placement=spread"])
    with pytest.raises(UserError, match="keys and values must be non-empty strings"):
        load_config(ROOT / "configs/tiny.yaml", ["cluster.label_selector.zone="])
