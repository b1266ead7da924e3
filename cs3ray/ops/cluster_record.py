"""The local cluster `cs3 up` started, as recorded for the other commands (`$CS3_HOME/cluster.json`).

The record holds the cluster's addresses, its processes and the token file's path; never a token.
A record whose head process is gone is stale and reads as no cluster.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

RECORD = "cluster.json"


def home() -> Path:
    """Where cs3 keeps per-user state: $CS3_HOME, default ~/.cs3."""
    return Path(os.environ.get("CS3_HOME", "~/.cs3")).expanduser()


@dataclass
class LocalCluster:
    address: str          # what ray.init takes (host:port of the GCS)
    dashboard_url: str    # what the job API takes
    pids: list[int]       # `ray start --block` of the head, then of each worker node (each its own group)
    num_cpus: int
    labels: dict[str, str] = field(default_factory=dict)
    log_dir: str = ""

    def alive(self) -> bool:
        """The head process still runs."""
        return bool(self.pids) and pid_running(self.pids[0])


def pid_running(pid: int) -> bool:
    """The process exists and is not a zombie: a `ray start` that `cs3 up` left behind is nobody's child once
    `cs3 up` has exited, and where init does not reap orphans (a container's) it stays a zombie after exiting."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not os.path.isdir("/proc")  # gone meanwhile; or no procfs (macOS): the live pid is it
    except (OSError, IndexError):
        return True


def read_record(path: Path | None = None) -> LocalCluster | None:
    """The recorded cluster, alive or not; None when there is no readable record."""
    path = path or home() / RECORD
    try:
        return LocalCluster(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_record(cluster: LocalCluster) -> None:
    path = home() / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cluster), indent=1))
    os.replace(tmp, path)


def clear_record() -> None:
    (home() / RECORD).unlink(missing_ok=True)


def recorded_cluster() -> LocalCluster | None:
    """The cluster `cs3 up` started, if it still runs."""
    cluster = read_record()
    return cluster if cluster is not None and cluster.alive() else None
