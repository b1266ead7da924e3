"""`cs3 status`: a cluster's nodes, resources, running trainings and Serve applications."""

from __future__ import annotations

import os
from typing import Any

from .cluster import ClusterError, ray_cluster
from .cluster_record import recorded_cluster


def cluster_status(address: str | None) -> dict[str, Any]:
    """What runs on the cluster at `address` (or RAY_ADDRESS, or the one `cs3 up` started); never an embedded one."""
    import ray

    local = recorded_cluster()
    target = address or os.environ.get("RAY_ADDRESS") or (local.address if local else None)
    if not target:
        raise ClusterError("no cluster to show: start one with `cs3 up`, or pass --address / set RAY_ADDRESS.")
    with ray_cluster(target, quiet=True):
        from ray.util.state import list_actors

        nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"], "head": "node:__internal_head__" in n["Resources"],
                  "cpus": n["Resources"].get("CPU", 0), "gpus": n["Resources"].get("GPU", 0),
                  "labels": {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}}
                 for n in ray.nodes() if n["Alive"]]
        total, free = ray.cluster_resources(), ray.available_resources()
        actors = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False)
        trainings = sorted({a.name or a.actor_id for a in actors if a.class_name == "TrainController"})
        apps: dict[str, str] = {}
        if any(a.class_name == "ServeController" for a in actors):
            from ray import serve

            apps = {name: str(app.status.value if hasattr(app.status, "value") else app.status)
                    for name, app in serve.status().applications.items()}
    return {"address": target, "nodes": nodes,
            "resources": {k: {"total": total[k], "free": free.get(k, 0.0)} for k in ("CPU", "GPU", "memory")
                          if k in total},
            "trainings": trainings, "serve_apps": apps}
