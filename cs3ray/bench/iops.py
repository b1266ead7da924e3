"""Random 4 KiB reads per second with O_DIRECT on a local folder: the device's IOPS, never the page cache.

A probe file is written with O_DIRECT (so none of it sits in the page cache), then several processes,
each with several threads, read random 4 KiB-aligned blocks of it through their own O_DIRECT file
descriptor into page-aligned buffers for a fixed window. Processes, not threads alone: one Python
process spends a few microseconds of interpreter time per read, which would cap the figure far below
an NVMe drive's. A filesystem that refuses O_DIRECT (tmpfs, many network mounts) cannot be measured:
`Unmeasurable` carries the reason.
"""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor

from cs3ray.direct_io import ALIGN, aligned_empty, supported

BLOCK = 4096
_CHUNK = 8 << 20
# Filesystems that are memory: since Linux 6.6 tmpfs takes O_DIRECT, but what it reads is the page cache.
MEMORY_FS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


class Unmeasurable(Exception):
    """This location cannot be measured with O_DIRECT; the message says why."""


def filesystem(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem `path` lies on (its longest mount point), or None where it cannot be read."""
    path = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                # ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER
                point = fields[4].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[fields.index("-") + 1]
    except (OSError, ValueError, IndexError):
        return None
    return fstype


def write_probe(path: str, nbytes: int) -> None:
    """A file of `nbytes` random bytes written with O_DIRECT in 8 MiB chunks (nothing left in the page cache)."""
    if not supported():
        raise Unmeasurable("this platform has no O_DIRECT")
    chunk = aligned_empty(_CHUNK)
    chunk[:] = memoryview(os.urandom(_CHUNK))  # incompressible: a compressing device gets no shortcut
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise Unmeasurable(f"the filesystem of {os.path.dirname(path)} refuses O_DIRECT (tmpfs?)") from None
        raise
    try:
        left = nbytes - nbytes % ALIGN
        while left > 0:
            n = os.write(fd, memoryview(chunk)[:min(left, _CHUNK)])
            left -= n
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.remove(path)
        if exc.errno == errno.EINVAL:
            raise Unmeasurable(f"the filesystem of {os.path.dirname(path)} refuses O_DIRECT writes") from None
        raise
    os.close(fd)


def _reads(path: str, start_at: float, seconds: float, threads: int, seed: int) -> tuple[int, float]:
    """Random O_DIRECT 4 KiB reads done by `threads` threads from `start_at` for about `seconds`, and when the
    last thread stopped (a pool worker)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        blocks = os.fstat(fd).st_size // BLOCK
        counts, ends = [0] * threads, [start_at] * threads

        def loop(i: int) -> None:
            buf = mmap.mmap(-1, BLOCK)  # anonymous maps are page-aligned, as O_DIRECT needs
            rng = random.Random(seed * 1000 + i)
            while time.time() < start_at:
                time.sleep(0.001)
            end, n = start_at + seconds, 0
            while True:
                for _ in range(64):  # the clock read every 64 reads, not every one
                    os.preadv(fd, [buf], rng.randrange(blocks) * BLOCK)
                n += 64
                if time.time() >= end:
                    break
            counts[i], ends[i] = n, time.time()

        pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return sum(counts), max(ends)
    finally:
        os.close(fd)


def measure(folder: str, file_mb: int, seconds: float, rounds: int, procs: int | None = None,
            threads: int = 8) -> tuple[list[float], str]:
    """Reads per second of each of `rounds` windows of `seconds`, on a `file_mb` MiB probe file in `folder`
    (removed afterwards), and what was run. Raises Unmeasurable where O_DIRECT is refused."""
    procs = procs or min(16, os.cpu_count() or 1)
    os.makedirs(folder, exist_ok=True)
    if (fstype := filesystem(folder)) in MEMORY_FS:
        raise Unmeasurable(f"{folder} is on {fstype}: memory, not storage (its reads are the page cache)")
    path = os.path.join(folder, f".cs3-iops-{os.getpid()}.bin")
    try:
        write_probe(path, file_mb << 20)
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise Unmeasurable(f"the filesystem of {folder} refuses O_DIRECT reads") from None
            raise
        rates = []
        # spawn: the caller may hold threads (Ray's), which a forked child must not inherit half-locked
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(abs, range(procs)))  # start every worker before the first window
            for r in range(rounds):
                start_at = time.time() + 0.2
                done = list(pool.map(_reads, [path] * procs, [start_at] * procs, [seconds] * procs,
                                     [threads] * procs, [r * procs + p for p in range(procs)]))
                rates.append(sum(n for n, _ in done) / (max(end for _, end in done) - start_at))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return rates, (f"random 4 KiB O_DIRECT reads of a {file_mb} MiB file in {folder}, {procs} processes x "
                   f"{threads} threads, {rounds} windows of {seconds:g} s")
