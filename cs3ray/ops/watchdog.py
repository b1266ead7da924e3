"""Nothing an embedded Ray cluster runs outlives the command that started it, even a `kill -9` of it.

Ray ends an embedded cluster's processes on `ray.shutdown()`, but when its driver dies without one,
its dashboard and runtime-env agents and Serve's HAProxy (still holding the Serve port) live on, and
the agents ignore SIGTERM. So a small watchdog process waits on a pipe only the command holds, noting
the command's process tree every second meanwhile; when the pipe closes, however the command ended,
it ends what it noted and what those started since (SIGTERM, then SIGKILL) and removes the cluster's
private HAProxy folder. Processes started while the cluster starts also carry a marker in their
environment, which their children inherit (a process that renames itself, as Ray's agents do, may
overwrite it: the tree is the main record). Processes of any other Ray are untouched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

MARKER = "CS3_CLUSTER_OWNER"
GRACE_S = 3.0  # after SIGTERM, before SIGKILL: a raylet stops its workers itself when given the time
NOTE_S = 1.0  # how often the command's process tree is noted (a /proc scan: a few ms)
SWEEP_S = 10.0  # the sweep gives up after this long (a process that survives SIGKILL is not ours to fix)
_held: list[int] = []  # write ends of the watchdogs' pipes, open for this process's life


@contextlib.contextmanager
def watched_cluster() -> Iterator[str]:
    """Around the start of an embedded cluster: its processes are marked, and a watchdog ends them
    when this process ends, however it ends. Yields the marker's value."""
    from .cluster_env import HAPROXY_DIR_PREFIX

    value = f"{os.getpid()}-{secrets.token_hex(8)}"
    haproxy_dir = os.path.dirname(os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH", ""))
    folders = [haproxy_dir] if os.path.basename(haproxy_dir).startswith(HAPROXY_DIR_PREFIX) else []
    read_end, write_end = os.pipe()  # neither end is inherited by the cluster's processes
    # Its own session: a Ctrl-C in the terminal reaches the command, which stops the cluster itself.
    subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), value, *folders], stdin=read_end,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.close(read_end)
    _held.append(write_end)  # its closing, when this process ends, is the watchdog's signal
    saved = os.environ.get(MARKER)
    os.environ[MARKER] = value
    try:
        yield value
    finally:
        # Only the cluster's processes carry it: later children of this command are not the cluster's.
        if saved is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = saved



def processes() -> dict[int, tuple[int, str]]:
    """Every process of this machine: pid -> (parent pid, start time, which tells a reused pid apart)."""
    table = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":  # a zombie holds nothing but its pid
                table[int(proc.name)] = (int(fields[1]), fields[19])
    return table


def tree(roots: set[int], table: dict[int, tuple[int, str]]) -> set[int]:
    """`roots` (those alive) and every process under them."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [pid for pid in roots if pid in table]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def marked(value: str) -> set[int]:
    """Pids of this user's processes whose environment carries MARKER=value (this one excepted)."""
    needle = f"{MARKER}={value}".encode()
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                pids.add(int(proc.name))
        except OSError:  # gone, or another user's
            pass
    return pids


def members(value: str, noted: dict[int, str]) -> set[int]:
    """The cluster's live processes: those noted (same start time), those marked, and all under them."""
    table = processes()
    roots = {pid for pid, start in noted.items() if table.get(pid, (0, ""))[1] == start} | marked(value)
    return tree(roots, table) - {os.getpid()}


def sweep(value: str, noted: dict[int, str] | None = None, grace_s: float = GRACE_S,
          limit_s: float = SWEEP_S) -> set[int]:
    """End the cluster's processes: SIGTERM, then SIGKILL after grace_s; returns those found."""
    found: set[int] = set()
    start = time.monotonic()
    sig = signal.SIGTERM
    while (pids := members(value, noted or {})) and time.monotonic() - start < limit_s:
        found |= pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.1)
        if time.monotonic() - start > grace_s:
            sig = signal.SIGKILL
    return found


def note(owner: int, noted: dict[int, str]) -> None:
    """Add the processes now under `owner` to `noted` (pid -> start time)."""
    table = processes()
    for pid in tree({owner}, table) - {owner, os.getpid()}:
        noted[pid] = table[pid][1]


def main(argv: list[str]) -> int:
    """Note the command's process tree until its pipe closes, then end its cluster and remove its folders."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe says when the command is gone
    owner, value, folders = int(argv[0]), argv[1], argv[2:]
    noted: dict[int, str] = {}
    while True:
        note(owner, noted)
        try:
            ready, _, _ = select.select([0], [], [], NOTE_S)
            if ready and not os.read(0, 4096):
                break
        except OSError:
            break
    sweep(value, noted)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
