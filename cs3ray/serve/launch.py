"""Run a serve spec on a Ray cluster: size an embedded one, deploy detached or in the foreground, delete an app.

`cs3 serve` and jobs/serve.py both call `run_app`, so a job serves exactly as the command does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from cs3ray.config.schema import ServeConfig
from cs3ray.errors import UserError
from cs3ray.ops.cluster import ray_cluster

from .deploy import deploy, serve_foreground, stop
from .spec import ServeSpec


@dataclass(frozen=True)
class Served:
    """Where an application ran: its base URL and the cluster's address."""

    url: str
    address: str


def cluster_cpus(serve: ServeConfig) -> int:
    """Logical CPUs an embedded cluster declares: room for every replica (autoscaling: the maximum) and one more."""
    autoscaling = serve.max_replicas is not None and serve.min_replicas is not None
    wanted = serve.max_replicas if autoscaling else serve.replicas
    # A vLLM replica split over CPUs also reserves one for each of its tp x pp workers (deploy.placement).
    workers = serve.tp * serve.pp if serve.engine == "vllm" and serve.tp * serve.pp > 1 and not serve.num_gpus else 0
    return max(2, math.ceil(wanted * (serve.num_cpus + workers)) + 1)


def run_app(spec: ServeSpec, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
            detach: bool = False, on_ready: Callable[[str], None] = print) -> Served:
    """Deploy `spec` on the cluster at `address` (None: an embedded one sized by `cluster_cpus`).

    In the foreground: `on_ready(url)` once healthy, serve until SIGINT/SIGTERM, then delete the app.
    detach: leave the app on the (remote) cluster and return as soon as it is healthy.
    """
    if detach and not address:
        raise UserError("--detach needs --address: an embedded cluster ends with this command.")
    with ray_cluster(address, num_cpus=cluster_cpus(spec.serve), quiet=True, serving=True) as gcs:
        if detach:
            return Served(deploy(spec, host, port), address or gcs)
        urls: list[str] = []

        def ready(url: str) -> None:
            urls.append(url)
            on_ready(url)

        serve_foreground(spec, host, port, ready)
        return Served(urls[0], address or gcs)


def delete_app(name: str, address: str) -> None:
    """Delete the application `name` from the running cluster at `address`; others on it keep running."""
    with ray_cluster(address, quiet=True):
        stop(name)
