"""End a command's process as soon as its work is done.

Python's own exit tears every module down and collects the heap before the process ends: with torch and
Ray imported that is about a second of CPU (many seconds on a busy machine), after the command has
already printed its result, which whoever waits on the process (a shell, `ray job submit`, a test) waits
out. `exit_now` does what an exit must (joins the threads that are not daemons, runs the atexit
handlers: logging's flush, Ray's shutdown, weakref finalizers such as temporary folders', flushes the
standard streams) and then ends the process with the same status, skipping the teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_code(code: object) -> int:
    """The status `sys.exit(code)` would give: None is 0, an int itself, anything else is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def exit_now(code: object = 0) -> None:
    """Finish as `sys.exit(code)` would, without the interpreter's teardown."""
    status = exit_code(code)
    if threading.current_thread() is threading.main_thread():
        # What the interpreter's exit does first: the threading exit hooks (thread pools let their idle
        # workers go), then a join of every thread that is not a daemon.
        threading._shutdown()  # noqa: SLF001
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit runs, in their order
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
                pass
        os._exit(status)
