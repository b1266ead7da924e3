"""Run by test_topology.py in a subprocess: 2 simulated nodes (ray.cluster_utils.Cluster), 4 workers.

Each worker discovers its topology with tp=2, then syncs a gradient with hierarchical int8
compression over that topology (shared memory between the two workers of a node, int8 across
the nodes: what `compression.hierarchical` runs) and writes both to a file; this script prints
all of them as one JSON list. A subprocess keeps this cluster away from the session's one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import ray
from ray.cluster_utils import Cluster


def hierarchical_sync(topo) -> dict:
    """The hierarchical int8 mean and reduce-scatter of this rank's gradient, against gloo's fp32 ones."""
    import hashlib

    import torch
    import torch.distributed as dist

    from cs3ray.core.compress import HierarchicalAllReduce, make_codec

    world, rank = topo.world, topo.rank
    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    exact = torch.stack(grads).mean(0)
    reduce = HierarchicalAllReduce(make_codec("int8"), topo)
    try:
        mean = reduce("grad", grads[rank].clone())
        shard = torch.empty(4096 // world)
        reduce.reduce_scatter("shard", grads[rank].clone(), shard)
        gloo = grads[rank].clone()
        dist.all_reduce(gloo)
        return {"nodes": reduce.nodes, "local_size": reduce.local_size, "shm": reduce.local is not None,
                "mean_err": float((mean - exact).abs().max()), "scale": float(exact.abs().max()),
                "gloo_err": float((gloo / world - exact).abs().max()),
                "shard_err": float((shard - exact.view(world, -1)[rank]).abs().max()),
                "mean_sha": hashlib.sha256(mean.numpy().tobytes()).hexdigest(),
                "bytes_sent": reduce.stats.bytes_sent, "fp32_ring_bytes": reduce.stats.fp32_ring_bytes}
    finally:
        reduce.close()


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
                   "tp_group_nodes": sorted({topo.node_ids[r] for r in topo.tp_group_ranks()}),
                   "hierarchical": hierarchical_sync(topo)}, f)


def main() -> None:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster()
    for zone in ("a", "b"):  # the first is the head; no dashboard (nothing here reads it: it only takes CPU)
        cluster.add_node(num_cpus=2, labels={"zone": zone}, **({} if cluster.head_node else {"include_dashboard": False}))
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
        # SIGKILL: a graceful stop of each node takes many seconds here, and nothing is left to save.
        for node in [*cluster.worker_nodes, cluster.head_node]:
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
