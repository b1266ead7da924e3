"""`exit_now` ends a process as `sys.exit` would (its status, its atexit handlers, its threads' work, its
buffered output), only without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cs3ray.ops.process_exit import exit_code

CHILD = """
import atexit, sys, threading, time
from pathlib import Path
from cs3ray.ops.process_exit import exit_now
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.2), (out / "thread").write_text("done"))).start()
from concurrent.futures import ThreadPoolExecutor
ThreadPoolExecutor(2).submit(lambda: None).result()  # an idle pool, never shut down: its workers must not hang the exit
print("buffered, never flushed by hand", end="")
exit_now({code})
"""


@pytest.mark.parametrize("code, status", [("3", 3), ("'bad input'", 1)])
def test_exit_now_keeps_what_an_exit_does(tmp_path, code, status):
    proc = subprocess.run([sys.executable, "-c", CHILD.format(code=code), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, never flushed by hand"
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "done"
    assert proc.stderr.strip() == ("bad input" if status == 1 else "")


def test_exit_code_is_what_sys_exit_gives():
    assert [exit_code(c) for c in (None, 0, 2, 256 + 5)] == [0, 0, 2, 5]
