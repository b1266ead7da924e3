"""Ray Serve settings for a streaming replica whose engine runs in a process of its own.

Serve reads the replica's switches from its environment when the replica starts, so they go
into its runtime_env (on any cluster). Each streamed chunk otherwise costs a thread hop (figures:
docs/benchmarks.md). The cluster-wide switches (Serve's proxy, worker niceness, HAProxy ingress)
are cs3ray.ops.cluster_env's.
"""

from __future__ import annotations

import gc
import sys

# Our routes never block the event loop (the engine is another process), so Serve's extra
# thread + loop for user code only adds a cross-thread hop to every chunk.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
SWITCH_INTERVAL_S = 0.0002


def replica_actor_options(options: dict) -> dict:
    """Ray actor options for a replica: `options` plus REPLICA_ENV in its runtime_env (the user's own
    environment variables win)."""
    env = dict(REPLICA_ENV)
    runtime_env = dict(options.get("runtime_env") or {})
    env.update(runtime_env.get("env_vars") or {})
    runtime_env["env_vars"] = env
    return {**options, "runtime_env": runtime_env}


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
