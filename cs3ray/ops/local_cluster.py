"""`cs3 up` / `cs3 down` / `cs3 status`: a Ray cluster on this machine with token auth, for trying multi-node runs.

The head and each extra worker node are `ray start --block` processes, each the leader of its own
process group; `down` signals exactly those groups and never runs `ray stop`, which would stop every
Ray on the machine. The record (cs3ray.ops.cluster_record) names addresses and processes, not the token.

Closed by default: the nodes run with Ray's token auth whether or not a token existed (cs3 makes
one, owner-only, where Ray looks for it) and bind 127.0.0.1 unless `--host` names an address.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from .cluster import ClusterError, default_num_cpus
from .cluster_env import export_cluster_env
from .cluster_record import LocalCluster, clear_record, home, pid_running, read_record, recorded_cluster, write_record
from .ports import free_port
from .ray_auth import MODE, disabled_by_user, ensure_token, use_token_auth

LOOPBACK_START = "cs3ray.ops.loopback_start"  # `ray start` keeping a loopback node address
DRAIN_TIMEOUT = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # how long a SIGTERMed `ray start` drains its node first
# As many logical CPUs as the embedded cluster of configs/tiny.yaml (2 workers of 1 CPU) declares.
DEFAULT_CPUS = default_num_cpus(2, 1)


def parse_labels(text: str | None) -> dict[str, str]:
    """'key=value[,key=value]' -> a dict; one ClusterError naming a malformed pair."""
    labels: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in (text or "").split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise ClusterError(f"--labels: '{pair}' is not key=value.")
        labels[key] = value
    return labels


def _start(args: list[str], log: str, host: str) -> int:
    # `ray start` enables token auth only when a token already exists: the mode is set, never left to chance.
    env = dict(os.environ) if disabled_by_user() else dict(os.environ, **{MODE: "token"})
    # `cs3 down` stops every node at once: Ray's drain on SIGTERM (up to 30 s waiting for the node to go idle, so
    # that a rolling upgrade's Serve proxies can quiesce) has no other node to hand work to. The user's value is kept.
    env.setdefault(DRAIN_TIMEOUT, "0")
    ray = [sys.executable, "-m", LOOPBACK_START] if ipaddress.ip_address(host).is_loopback else ["ray"]
    with open(log, "ab") as out:
        proc = subprocess.Popen([*ray, "start", "--block", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return proc.pid


def _wait_dashboard(url: str, pid: int, log: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not _running(pid):
            raise ClusterError(f"`ray start --head` exited early; its output is in {log}.")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answered (token auth may refuse the request itself)
        except OSError:
            time.sleep(0.5)
    raise ClusterError(f"the Ray head did not answer within {timeout:.0f} s; its output is in {log}.")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A finished child of this process stays a zombie until reaped: not running either.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return pid_running(pid)  # another's (`cs3 down` after `cs3 up`): a zombie there has exited too


def alive_nodes(dashboard_url: str) -> list[Any]:
    """The cluster's alive nodes, from its state API."""
    from ray.util.state import list_nodes

    return list_nodes(address=dashboard_url, filters=[("state", "=", "ALIVE")], detail=True,
                      raise_on_missing_output=False)


def up(workers: int = 0, num_cpus: int | None = None, labels: dict[str, str] | None = None,
       timeout: float = 120.0, host: str = "127.0.0.1") -> tuple[LocalCluster, bool]:
    """Start a head (and `workers` worker nodes) on `host` unless `cs3 up` already did; (cluster, started)."""
    running = recorded_cluster()
    if running is not None:
        return running, False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ClusterError(f"--host '{host}' is not an IP address of this machine.") from None
    ensure_token()
    use_token_auth()  # this command's own calls (node list) send it too
    export_cluster_env(serving=False)  # Serve's proxy switches, as on an embedded cluster
    cpus = num_cpus or DEFAULT_CPUS
    logs = home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    port, dash = free_port(), free_port()
    label_arg = ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())] if labels else []
    head_log = str(logs / "head.log")
    # Every port free: the defaults (6379, 8265, the job agent's 52365) may belong to another Ray here.
    # The node address is also the address Ray's servers bind: on 127.0.0.1 nothing listens beyond this machine.
    pids = [_start(["--head", f"--node-ip-address={host}", f"--port={port}", f"--num-cpus={cpus}",
                    "--include-dashboard=true", f"--dashboard-host={host}", f"--dashboard-port={dash}",
                    f"--dashboard-agent-listen-port={free_port()}", *label_arg], head_log, host)]
    where = f"[{host}]" if ":" in host else host
    cluster = LocalCluster(f"{where}:{port}", f"http://{where}:{dash}", pids, cpus, dict(labels or {}), str(logs))
    write_record(cluster)  # from here on, `cs3 down` can stop what was started, even if this fails
    _wait_dashboard(cluster.dashboard_url, pids[0], head_log, timeout)
    for i in range(workers):
        pids.append(_start([f"--address={cluster.address}", f"--node-ip-address={host}", f"--num-cpus={cpus}",
                            *label_arg], str(logs / f"worker-{i + 1}.log"), host))
        write_record(cluster)
    deadline = time.time() + timeout
    while len(alive_nodes(cluster.dashboard_url)) < 1 + workers:
        if time.time() > deadline:
            raise ClusterError(f"only {len(alive_nodes(cluster.dashboard_url))} of {1 + workers} nodes joined within "
                               f"{timeout:.0f} s; their output is in {logs}.")
        time.sleep(0.5)
    return cluster, True


def down(timeout: float = 30.0) -> LocalCluster | None:
    """Stop the processes `cs3 up` started (worker nodes first) and forget them; None when there were none."""
    cluster = read_record()
    if cluster is None:
        return None
    for pid in reversed(cluster.pids):
        _signal_group(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while any(_running(p) for p in cluster.pids) and time.time() < deadline:
        time.sleep(0.3)
    for pid in cluster.pids:
        if _running(pid):
            _signal_group(pid, signal.SIGKILL)
    clear_record()
    return cluster


def _signal_group(pid: int, sig: int) -> None:
    if not _is_ray_start(pid):
        return  # gone, or its pid reused by another program: never signal that
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _is_ray_start(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except FileNotFoundError:
        return _running(pid) and not os.path.isdir("/proc")  # no procfs (macOS): trust the live pid
    except OSError:
        return False
    ray = any(a.endswith(b"ray") for a in args[:2]) or LOOPBACK_START.encode() in args[:3]
    return ray and b"start" in args
