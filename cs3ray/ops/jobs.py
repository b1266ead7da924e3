"""Ray jobs on a cluster, through Ray's own `JobSubmissionClient`: submit a training run, list, follow, stop.

Addresses. The job API lives on the dashboard (`http://host:8265`), as for `ray job submit`; a
cluster address (`host:6379`, what `ray.init` takes) is resolved to its dashboard through the
cluster when it can be, and the caller says which URL it used. Token auth: Ray's client reads
`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token` once `RAY_AUTH_MODE=token`, which a
token file on this machine turns on (as for `ray.init`). Nothing here stores a token.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from cs3ray.config import JobConfig

from .cluster import ClusterError, probe
from .cluster_record import recorded_cluster
from .ray_auth import join_with_token

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
RUN_KEY = "cs3_run"  # the job metadata key naming the run a `cs3 submit` job trains
# Besides .gitignore and .rayignore, which Ray honours itself: never upload the repository's history.
EXCLUDES = [".git"]


@dataclass(frozen=True)
class Dashboard:
    url: str
    how: str  # how the URL was found, for the one line that says which cluster a command used


@contextlib.contextmanager
def _explicit_address() -> Iterator[None]:
    # Ray's job client prefers RAY_ADDRESS / RAY_API_SERVER_ADDRESS over the address it is given.
    saved = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def resolve_dashboard(address: str | None) -> Dashboard:
    """The dashboard URL of --address / RAY_ADDRESS: an http(s) URL as given, a cluster address via the cluster."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address and (local := recorded_cluster()) is not None:
        join_with_token()
        return Dashboard(local.dashboard_url, f"the cluster `cs3 up` started ({local.dashboard_url})")
    if not address:
        raise ClusterError("no Ray cluster named: pass --address http://HEAD:8265 (the dashboard), set RAY_ADDRESS, "
                           "or start one here with `cs3 up`.")
    join_with_token()
    if address.startswith(("http://", "https://")):
        parsed = urllib.parse.urlsplit(address)
        probe(f"{parsed.hostname}:{parsed.port or (443 if parsed.scheme == 'https' else 80)}")
        return Dashboard(address.rstrip("/"), f"dashboard {address}")
    probe(address)
    try:
        from ray.dashboard.utils import ray_address_to_api_server_url

        with _explicit_address():
            url = ray_address_to_api_server_url(address.removeprefix("ray://"))
    except Exception as exc:  # noqa: BLE001 - Ray raises several kinds; one sentence for all
        raise ClusterError(f"cannot find the dashboard of the Ray cluster at '{address}' ({_first_line(exc)}); "
                           "pass its URL, e.g. --address http://HEAD:8265.") from None
    return Dashboard(url, f"dashboard {url} of cluster {address}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def client(dashboard: Dashboard):
    """A JobSubmissionClient for the dashboard; an unreachable one or a refused token is one ClusterError."""
    from ray.job_submission import JobSubmissionClient

    # Ray's client logs every ignored file of the upload and each websocket event at INFO.
    for name in ("ray._private.runtime_env.packaging", "ray.dashboard.modules.dashboard_sdk",
                 "ray.dashboard.modules.job.sdk"):
        logging.getLogger(name).setLevel(logging.WARNING)

    try:
        with _explicit_address():
            return JobSubmissionClient(dashboard.url)
    except Exception as exc:  # noqa: BLE001
        raise _client_error(dashboard, exc) from None


def _client_error(dashboard: Dashboard, exc: BaseException) -> ClusterError:
    text = _first_line(exc)
    if any(s in str(exc) for s in ("401", "403", "Unauthorized", "unauthorized", "token")):
        return ClusterError(f"the Ray cluster at {dashboard.url} refused the auth token ({text}); check "
                            "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.")
    return ClusterError(f"cannot use the Ray job API at {dashboard.url}: {text}")


def call(dashboard: Dashboard, fn: Callable[[], Any]) -> Any:
    """Run one job API call, its failures as one ClusterError (a missing job id reads as such)."""
    try:
        return fn()
    except ClusterError:
        raise
    except Exception as exc:  # noqa: BLE001
        if "does not exist" in str(exc) or "not found" in str(exc).lower():
            raise ClusterError(f"no such job on {dashboard.url}: {_first_line(exc)}") from None
        raise _client_error(dashboard, exc) from None


def cluster_is_local(dashboard: Dashboard) -> bool:
    """True when the dashboard runs on this machine (then the job's files are this machine's files)."""
    host = urllib.parse.urlsplit(dashboard.url).hostname or ""
    if host in ("127.0.0.1", "localhost", "::1"):
        return True
    import socket

    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return host in mine


def node_count(dashboard: Dashboard) -> int | None:
    """Alive nodes of the cluster, or None when its state API does not answer."""
    try:
        from ray.util.state import list_nodes

        with _explicit_address():
            nodes = list_nodes(address=dashboard.url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
        return len(nodes)
    except Exception:  # noqa: BLE001 - only used for a warning
        return None


def run_dir_override(cfg: JobConfig, dashboard: Dashboard, cwd: str) -> tuple[list[str], str | None]:
    """(extra overrides, warning) for the run directory of a submitted job.

    A relative local run.dir would land in Ray's unpacked copy of the working dir. On a cluster on
    this machine it is made absolute against `cwd`, so `cs3` commands run there find the run; on a
    cluster of several nodes the nodes cannot share a local path, which the warning says.
    """
    path = cfg.run.path()
    if "://" in path or os.path.isabs(os.path.expanduser(path)):
        return [], None
    if cluster_is_local(dashboard):
        nodes = node_count(dashboard)
        warning = (f"run.dir '{path}' is a local path and the cluster has {nodes} nodes: only this machine's "
                   "nodes see it; use shared storage (an fsspec URL) for run.dir." if nodes and nodes > 1 else None)
        return [f"run.dir={os.path.join(cwd, path)}"], warning
    return [], (f"run.dir '{path}' is a local relative path: it will be written inside the job's working directory "
                "on the cluster's nodes, which they do not share; use shared storage (an fsspec URL) for run.dir.")


def entrypoint(working_dir: str) -> list[str]:
    """How the job starts training: the working dir's own jobs/train.py (this repository: the uploaded code
    runs), else the `cs3 train` of the cs3ray installed on the cluster."""
    if os.path.isfile(os.path.join(working_dir, "jobs", "train.py")):
        return ["python", "jobs/train.py"]
    return ["python", "-m", "cs3ray_cli.main", "train"]


def submit(dashboard: Dashboard, config: str, overrides: list[str], working_dir: str, env_vars: dict[str, str],
           pip: list[str], extra_args: list[str], run_name: str | None = None) -> str:
    """Submit a training run of CONFIG (relative to the working dir) with the working dir; returns the job id.
    `run_name` goes into the job's metadata, where `active_job_of_run` finds it."""
    entry = [*entrypoint(working_dir), config, *overrides, *extra_args]
    runtime_env: dict[str, Any] = {"working_dir": working_dir, "excludes": EXCLUDES}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    if pip:
        runtime_env["pip"] = pip
    jobs = client(dashboard)
    metadata = {RUN_KEY: run_name} if run_name else None
    return call(dashboard, lambda: jobs.submit_job(entrypoint=shlex.join(entry), runtime_env=runtime_env,
                                                   metadata=metadata))


def active_job_of_run(dashboard: Dashboard, run_name: str) -> str | None:
    """The id of a pending or running job that `cs3 submit` started for `run_name`, or None."""
    jobs = client(dashboard)
    for info in call(dashboard, jobs.list_jobs):
        status = getattr(info.status, "value", str(info.status))
        if (info.metadata or {}).get(RUN_KEY) == run_name and status not in TERMINAL:
            return info.submission_id or info.job_id
    return None


def describe(info: Any) -> dict[str, Any]:
    """The fields of a job's info that `cs3 jobs` shows."""
    status = getattr(info.status, "value", str(info.status))
    return {"id": info.submission_id or info.job_id, "status": status, "entrypoint": info.entrypoint,
            "start_time": info.start_time, "end_time": info.end_time, "message": info.message}
