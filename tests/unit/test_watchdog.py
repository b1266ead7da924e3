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
        marked = subprocess.Popen(["sleep", "300"], start_new_session=True)
    # Not marked (as an agent that overwrote its environment renaming itself): the noted tree has it.
    later = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    print(marked.pid, later.pid, folder, flush=True)
    time.sleep(300)
""")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_of_the_command_ends_what_it_started(tmp_path):
    bystander = subprocess.Popen(["sleep", "300"])  # another process of the machine: left alone
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        marked, later, folder = owner.stdout.readline().split()
        time.sleep(1.5)  # the watchdog notes the tree every second
        started = [int(marked), int(later), *map(int, Path(f"/proc/{later}/task/{later}/children").read_text().split())]
        assert len(started) == 3 and all(map(alive, started)) and Path(folder).is_dir()
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.time() + 15
        while any(map(alive, started)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(alive, started))
        assert alive(bystander.pid)
        deadline = time.time() + 5
        while Path(folder).exists() and time.time() < deadline:
            time.sleep(0.1)
        assert not Path(folder).exists()  # the cluster's private HAProxy folder too
    finally:
        owner.kill()
        owner.wait()
        bystander.kill()
        bystander.wait()
