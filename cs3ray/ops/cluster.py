"""Connect to a Ray cluster: an embedded local one by default, or an existing one by address."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from typing import Iterator

from cs3ray.errors import UserError

from .cluster_env import export_cluster_env
from .cluster_record import recorded_cluster
from .json_logs import ray_logging_config
from .ray_auth import ensure_token, join_with_token, use_token_auth
from .watchdog import watched_cluster

# Ray's switch for single-machine clusters (its default on macOS and Windows): see loopback_node.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class ClusterError(UserError):
    """The Ray cluster named by --address / RAY_ADDRESS cannot be reached."""


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """A new single-node cluster started inside has every server on 127.0.0.1; a join inside keeps 127.0.0.1.

    ray.init() turns a loopback node address into the machine's own (so other machines could join),
    except in the mode Ray runs clusters in on macOS and Windows, where a cluster is one machine;
    there the GCS, raylet, workers, agents and metrics servers all bind 127.0.0.1. An embedded
    cluster is one machine, so it starts in that mode; the switch is undone on exit, before this
    process might join a real cluster. (Measured listeners: docs/operations.md, section 5.)
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(LOOPBACK_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_SWITCH] = "0"  # the cluster's own processes read it when they import ray
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported ray before the variable was set
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(LOOPBACK_SWITCH, None)
        else:
            os.environ[LOOPBACK_SWITCH] = saved_env


def probe(address: str, timeout: float = 5.0) -> None:
    """Fail fast on an address nothing listens at: Ray itself retries its GCS for minutes."""
    if address in ("auto", "local"):
        return
    target = address.split("://", 1)[-1]
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"Ray address '{address}' must look like host:port or ray://host:port.")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ClusterError(f"cannot reach the Ray cluster at '{address}' ({exc.strerror or exc}). "
                           "Check --address / RAY_ADDRESS, or start one with `ray start --head`.") from None


def _is_loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_num_cpus(workers: int, cpus_per_worker: float) -> int:
    """Logical CPUs for an embedded cluster: the workers, plus room for data tasks and a replica.

    Logical CPUs are a scheduling budget, not cores, so over-declaring lets training workers,
    Ray Data read tasks and a serve replica coexist on a 2-core laptop.
    """
    return max(os.cpu_count() or 1, int(workers * cpus_per_worker + 0.999) + 3)


@contextlib.contextmanager
def ray_cluster(address: str | None = None, num_cpus: int | None = None, quiet: bool = False,
                serving: bool = False, use_recorded: bool = True, log_format: str = "text") -> Iterator[str]:
    """Yield the address of a connected Ray cluster; an embedded one is shut down on exit.
    serving: an embedded cluster started to serve a model (its workers run at nice 0, see cluster_env).
    use_recorded: without an address, join the cluster `cs3 up` started (False: benchmarks, which compare
    on a cluster of their own).
    log_format: 'json' makes Ray's logging of this job's processes JSON (run.log_format; ops.json_logs)."""
    import logging

    import ray
    from ray.exceptions import AuthenticationError

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None and use_recorded and (local := recorded_cluster()) is not None:
        address = local.address
        if not quiet:
            print(f"using the cluster `cs3 up` started at {address}", file=sys.stderr)
    if address is not None and address.startswith(("http://", "https://")):
        local = recorded_cluster()
        if local is not None and local.dashboard_url == address.rstrip("/"):
            address = local.address  # the dashboard of the cluster `cs3 up` started: its address is known
    if address is not None and address.startswith(("http://", "https://")):
        raise ClusterError(f"'{address}' is a dashboard URL; this command joins the cluster itself and needs its "
                           "address, host:port (as `ray start --head` printed it).")
    embedded = address is None
    logging_config = ray_logging_config(log_format)
    before = list(logging.getLogger().handlers)
    try:
        if embedded:
            export_cluster_env(serving)  # Serve's proxy, should this cluster serve a model, reads it at start
            # Ray would make the token too, but with the umask's mode; and cs3 sends it either way.
            ensure_token()
            use_token_auth()
            # address="local": always a new cluster, even when `ray start` left one running here.
            with loopback_node(), watched_cluster():  # nothing of it outlives this process
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=not quiet,
                         configure_logging=not quiet, logging_level="ERROR" if quiet else "INFO",
                         logging_config=logging_config)
        else:
            probe(address)
            join_with_token()
            # Ray would turn a loopback address into the machine's own, where a loopback cluster is not.
            with loopback_node() if _is_loopback(address) else contextlib.nullcontext():
                ray.init(address=address, log_to_driver=not quiet, logging_level="ERROR" if quiet else "INFO",
                         logging_config=logging_config)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError, AuthenticationError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"the Ray cluster at '{address}'" if address else "an embedded Ray cluster"
        raise ClusterError(f"cannot connect to {where}: {first}. "
                           "Check --address / RAY_ADDRESS, or start one with `ray start --head`.") from None
    # ray.init adds a root handler with a logging_config: a second run in this process would log each line twice.
    added = [h for h in logging.getLogger().handlers if h not in before]
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        for handler in added:
            logging.getLogger().removeHandler(handler)
