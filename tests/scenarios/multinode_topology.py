"""Run by test_topology.py in a subprocess: 2 simulated nodes (ray.cluster_utils.Cluster), 4 workers.

Each worker discovers its topology with tp=2 and writes it to a file; this script prints
all of them as one JSON list. A subprocess keeps this cluster away from the session's one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster


def worker(config: dict) -> None:
    import ray.train

    from cs3ray.core.mesh import discover

    node = ray.get_runtime_context().get_node_id()
    labels = ray.nodes()
    zone = next(n["Labels"].get("zone") for n in labels if n["NodeID"] == node)
    topo = discover(tp=2, node_id=node)
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "zone": zone, "node": node, "node_rank": topo.node_rank,
                   "local_peers": topo.local_peers, "tp_group": topo.tp_group_ranks(),
                   "tp_group_nodes": sorted({topo.node_ids[r] for r in topo.tp_group_ranks()})}, f)


def main() -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster()
    for zone in ("a", "b"):
        cluster.add_node(num_cpus=2, labels={"zone": zone})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = tempfile.mkdtemp()
    try:
        TorchTrainer(worker, train_loop_config={"out": out},
                     scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
                     torch_config=TorchConfig(backend="gloo")).fit()
        rows = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
        print(json.dumps(sorted(rows, key=lambda r: r["rank"])))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
