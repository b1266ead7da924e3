"""The watchdog of an embedded cluster: what the command started ends with it, even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

OWNER = textwrap.dedent("""
    import os, subprocess, sys, tempfile, time
    folder = tempfile.mkdtemp(prefix="cs3-haproxy-")
    os.environ["RAY_SERVE_HAPROXY_SOCKET_PATH"] = os.path.join(folder, "admin.sock")
    from cs3ray.ops.watchdog import watched_cluster
    with watched_cluster():
        # As Ray's agents and HAProxy: a process of its own session, left to init when its parent dies.
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    later = subprocess.Popen(["sleep", "300"], start_new_session=True)  # started after: not the cluster's
    print(child.pid, later.pid, folder, flush=True)
    time.sleep(300)
""")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_command_ends_what_its_cluster_started(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    later = None
    try:
        child_pid, later, folder = owner.stdout.readline().split()
        child, later = int(child_pid), int(later)
        assert alive(child) and Path(folder).is_dir()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.time() + 15
        while alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(child)
        assert alive(later)  # only the marked processes: nothing else of the machine
        deadline = time.time() + 5
        while Path(folder).exists() and time.time() < deadline:
            time.sleep(0.1)
        assert not Path(folder).exists()  # the cluster's private HAProxy folder too
    finally:
        owner.kill()
        owner.wait()
        if later:
            os.kill(later, signal.SIGKILL)
