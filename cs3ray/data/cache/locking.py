"""Advisory file locks (flock), so the worker processes of one node can share an L2 directory.

flock locks belong to an open file description, so two threads of one process that each
open the lock file exclude each other just like two processes do; a crashed holder's lock
is released by the kernel, so no stale lock file can wedge the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: str, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive (or shared) lock on `path` (created if missing) for the block."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
