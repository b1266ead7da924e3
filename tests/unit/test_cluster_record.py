"""The record's liveness check: a `ray start` that `cs3 up` left behind has exited once it is a zombie."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from cs3ray.ops.cluster_record import LocalCluster, pid_running


def test_an_exited_orphan_is_not_running_whether_or_not_init_reaps_it():
    # As `cs3 up` leaves its nodes: started in their own session by a process that has exited since.
    spawn = ("import subprocess as s; print(s.Popen(['sleep', '60'], start_new_session=True, stdout=s.DEVNULL, "
             "stderr=s.DEVNULL).pid)")
    pid = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout)
    assert pid_running(pid) and LocalCluster("a", "b", [pid], 1).alive()
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 10
    while pid_running(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not pid_running(pid) and not LocalCluster("a", "b", [pid], 1).alive()
    assert not LocalCluster("a", "b", [], 1).alive()
