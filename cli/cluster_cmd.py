"""`cs3 up`, `cs3 down`, `cs3 status`: a Ray cluster on this machine, and what any cluster runs."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from cs3ray.ops.cluster_status import cluster_status
from cs3ray.ops.local_cluster import DEFAULT_CPUS, down, parse_labels, up

from .common import AddressOpt, JsonOpt, console, user_errors


@user_errors
def up_cmd(workers: int = typer.Option(0, "--workers", min=0, help="Extra worker nodes on this machine (to try "
                                                                    "multi-node behaviour)."),
           num_cpus: int = typer.Option(DEFAULT_CPUS, "--num-cpus", min=1, help="Logical CPUs of each node "
                                                                               "(default: as an embedded cluster of "
                                                                               "configs/tiny.yaml declares)."),
           labels: Optional[str] = typer.Option(None, "--labels", help="Node labels key=value[,key=value], "
                                                                       "on every node."),
           host: str = typer.Option("127.0.0.1", "--host", help="The address the nodes bind and advertise "
                                                                "(default: loopback, reachable from this machine "
                                                                "only; token auth either way)."),
           as_json: bool = JsonOpt) -> None:
    """Start a Ray head on 127.0.0.1 with token auth (and worker nodes); does nothing if `cs3 up` already did."""
    cluster, started = up(workers, num_cpus, parse_labels(labels), host=host)
    info = {"address": cluster.address, "dashboard": cluster.dashboard_url, "nodes": len(cluster.pids),
            "started": started, "logs": cluster.log_dir}
    if as_json:
        print(json.dumps(info))
        return
    console.print(f"{'started' if started else 'already running'}: {len(cluster.pids)} node(s), cluster address "
                  f"{cluster.address}, dashboard {cluster.dashboard_url}", highlight=False)
    console.print("cs3 train / submit / jobs / serve / status now use it unless --address or RAY_ADDRESS says "
                  "otherwise; `cs3 down` stops it.", highlight=False)


@user_errors
def down_cmd() -> None:
    """Stop the cluster `cs3 up` started (only its processes); nothing to do if there is none."""
    cluster = down()
    console.print(f"stopped the cluster at {cluster.address} ({len(cluster.pids)} node(s))" if cluster
                  else "no cluster started by `cs3 up` to stop", highlight=False)


@user_errors
def status_cmd(address: Optional[str] = AddressOpt, as_json: bool = JsonOpt) -> None:
    """Nodes, resources, running trainings and Serve applications of the cluster."""
    s = cluster_status(address)
    if as_json:
        print(json.dumps(s))
        return
    table = Table("node", "ip", "head", "CPU", "GPU", "labels", title=f"cluster {s['address']}")
    for n in s["nodes"]:
        table.add_row(n["node_id"][:12], n["ip"], "yes" if n["head"] else "", f"{n['cpus']:g}", f"{n['gpus']:g}",
                      ",".join(f"{k}={v}" for k, v in n["labels"].items()))
    console.print(table)
    for key, r in s["resources"].items():
        unit = 2**30 if key == "memory" else 1
        console.print(f"{key}: {r['free'] / unit:,.1f} free of {r['total'] / unit:,.1f}"
                      + (" GiB" if key == "memory" else ""), highlight=False)
    console.print(f"trainings running: {', '.join(s['trainings']) or 'none'}", highlight=False)
    console.print("serve apps: " + (", ".join(f"{k} ({v})" for k, v in s["serve_apps"].items()) or "none"),
              highlight=False)
