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

from cs3ray.storage import PRIVATE_FILE, makedirs_private


@contextlib.contextmanager
def file_lock(path: str, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive (or shared) lock on `path` (created if missing) for the block."""
    makedirs_private(os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
