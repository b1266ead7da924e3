"""Nothing an embedded Ray cluster runs outlives the command that started it, even a `kill -9` of it.

Ray ends an embedded cluster's processes on `ray.shutdown()`, but when its driver dies without one,
its agents and Serve's HAProxy (still holding the Serve port) live on. So every process started while
the cluster starts carries a marker in its environment (its workers, agents and HAProxy inherit it
from the raylet), and a small watchdog process waits on a pipe only the command holds: when the pipe
closes, however the command ended, the watchdog ends every process with the marker (SIGTERM, then
SIGKILL) and removes the cluster's private HAProxy folder. Processes of any other Ray are untouched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

MARKER = "CS3_CLUSTER_OWNER"
GRACE_S = 3.0  # after SIGTERM, before SIGKILL: a raylet stops its workers itself when given the time
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
    subprocess.Popen([sys.executable, "-m", __name__, value, *folders], stdin=read_end,
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



def marked(value: str) -> list[int]:
    """Pids of this user's live processes whose environment carries MARKER=value (this one excepted)."""
    needle = f"{MARKER}={value}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone, or another user's
            pass
    return pids


def sweep(value: str, grace_s: float = GRACE_S, limit_s: float = SWEEP_S) -> list[int]:
    """End every process marked with `value`: SIGTERM, then SIGKILL after grace_s; returns those found."""
    found: set[int] = set()
    start = time.monotonic()
    sig = signal.SIGTERM
    while (pids := marked(value)) and time.monotonic() - start < limit_s:
        found.update(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.1)
        if time.monotonic() - start > grace_s:
            sig = signal.SIGKILL
    return sorted(found)


def main(argv: list[str]) -> int:
    """Wait for the command's pipe to close, then end its cluster's processes and remove its folders."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe says when the command is gone
    value, folders = argv[0], argv[1:]
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    sweep(value)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
