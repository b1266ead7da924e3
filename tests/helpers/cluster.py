"""Start and stop real Ray head nodes for tests, without touching any other Ray on the machine.

`ray start --head --block` keeps the node's processes as its children; terminating it stops
exactly that node (a plain `ray stop` would kill every Ray cluster on the machine).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from cs3ray.ops.ports import free_port

# Processes push their metrics to the node's agent every 10 s by default: too slow for a short test run.
METRICS_ENV = {"RAY_metrics_report_interval_ms": "1000"}


@dataclass
class HeadNode:
    proc: subprocess.Popen
    address: str
    dashboard_url: str
    metrics_url: str  # Ray's Prometheus endpoint (every process's ray.util.metrics, through the node's agent)
    auth_env: dict[str, str] = field(default_factory=dict)  # RAY_AUTH_MODE and the token file of this head

    def env(self) -> dict[str, str]:
        """Environment for clients of this node: its address and its token."""
        return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS=self.address, **METRICS_ENV, **self.auth_env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                # A head node rarely finishes a graceful stop in under 10 s here; its processes
                # hold nothing a test still needs, so it gets a few seconds, then the group is killed.
                self.proc.wait(timeout=4)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_head(num_cpus: int = 8, extra: list[str] | None = None, env: dict | None = None,
               timeout: float = 90, token_dir: Path | None = None) -> HeadNode:
    """A head node on 127.0.0.1 with free ports; returns once it accepts connections.
    token_dir: token auth, with a token made in that folder (as cs3 makes one: owner-only)."""
    auth_env: dict[str, str] = {}
    if token_dir is not None:
        auth_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(token_dir) / "auth_token")}
        _make_token(auth_env["RAY_AUTH_TOKEN_PATH"])
    port, dash, agent, metrics = free_port(), free_port(), free_port(), free_port()
    # Every port chosen free: the defaults (6379, 8265, the job agent's 52365) would collide
    # with any other Ray node on the machine, and `ray job submit` would find no agent.
    cmd = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
           f"--num-cpus={num_cpus}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats",
           f"--metrics-export-port={metrics}",
           *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(env or os.environ, RAY_USAGE_STATS_ENABLED="0", **METRICS_ENV, **auth_env))
    node = HeadNode(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{dash}", f"http://127.0.0.1:{metrics}/metrics",
                    auth_env)
    deadline = time.time() + timeout
    import urllib.error
    import urllib.request

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            # The job API answers once the dashboard (and so the GCS) is up.
            urllib.request.urlopen(f"{node.dashboard_url}/api/version", timeout=2)
            return node
        except urllib.error.HTTPError:
            return node  # it answered (token auth may refuse the request itself)
        except OSError:
            time.sleep(1)
    node.stop()
    raise RuntimeError("ray head node did not come up in time")


def _make_token(path: str) -> None:
    from unittest import mock

    from cs3ray.ops.ray_auth import ensure_token

    with mock.patch.dict(os.environ, {"RAY_AUTH_TOKEN_PATH": path}):
        os.environ.pop("RAY_AUTH_TOKEN", None)
        ensure_token()


@contextlib.contextmanager
def simulated_nodes(count: int = 2, num_cpus: int = 1, labels: list[dict[str, str]] | None = None) -> Iterator:
    """A `ray.cluster_utils.Cluster` of `count` simulated nodes of `num_cpus` each (the first is the head), node i
    with `labels[i]`; nodes are SIGKILLed at the end: a graceful stop takes ~30 s here and nothing needs it."""
    from ray.cluster_utils import Cluster

    labels = labels or [{}] * count
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus, "labels": labels[0]})
    for i in range(1, count):
        cluster.add_node(num_cpus=num_cpus, labels=labels[i])
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        for node in [*cluster.worker_nodes, cluster.head_node]:
            cluster.remove_node(node, allow_graceful=False)
        cluster.shutdown()
