"""Large local files written with O_DIRECT: from our buffer to the disk, not through the page cache.

A buffered write copies every byte into newly allocated page-cache pages, which the kernel then
writes back and frees again when the file is deleted: far more CPU than O_DIRECT at the same disk
speed (figures: docs/benchmarks.md). Checkpoints write hundreds of MB per save, and on a host
whose cores training keeps busy that CPU time is what an async save costs the training steps
(DeepSpeed's FastPersist writes checkpoints with O_DIRECT for the same reason).

O_DIRECT needs the buffer address, file offset and length aligned to the device's block size:
an aligned buffer is written in place, anything else goes through a small aligned bounce
buffer, and the padded last block is cut off with ftruncate. Filesystems without O_DIRECT
(tmpfs, some network mounts) answer EINVAL, and the caller writes the ordinary way instead.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import numpy as np

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
MIN_BYTES = 1 << 20  # smaller files: the page cache costs little, and metadata reads stay cached
_BOUNCE_BYTES = 8 << 20
_local = threading.local()


def supported() -> bool:
    return hasattr(os, "O_DIRECT")


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` whose first byte sits on an ALIGN boundary."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes]


def _bounce() -> np.ndarray:
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = aligned_empty(_BOUNCE_BYTES)
    return buf


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]


def write_direct(path: str, data: Any, fsync: bool = True) -> bool:
    """Write `data` (any contiguous buffer) to a new file at `path` with O_DIRECT, fsynced unless told not to.

    Returns False, having left no file behind, when this platform or filesystem cannot do
    O_DIRECT; other OSErrors propagate (the partial file removed).
    """
    if not supported():
        return False
    src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)  # the owner's alone
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        body = src.nbytes - src.nbytes % ALIGN if src.ctypes.data % ALIGN == 0 else 0
        if body:
            _write_all(fd, memoryview(src[:body]))
        bounce = _bounce()
        for start in range(body, src.nbytes, _BOUNCE_BYTES):
            part = src[start:start + _BOUNCE_BYTES]
            padded = -(-part.nbytes // ALIGN) * ALIGN
            bounce[:part.nbytes] = part
            bounce[part.nbytes:padded] = 0
            _write_all(fd, memoryview(bounce[:padded]))
        os.ftruncate(fd, src.nbytes)  # drop the last block's padding
        if fsync:
            os.fsync(fd)  # the size and block map; the data is already on the device
    except OSError as exc:
        os.close(fd)
        os.remove(path)
        if exc.errno == errno.EINVAL:  # the filesystem took the flag but not these alignments
            return False
        raise
    os.close(fd)
    return True
