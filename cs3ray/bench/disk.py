"""`cs3 bench disk`: how much compute a checkpoint-sized write beside training costs on this host.

An async checkpoint hides the wait for the disk, not the CPU the write needs. With O_DIRECT
that is little on an ordinary host (the device copies straight from our buffers). In a VM whose
disk is emulated by the host and charged to the guest's own vCPUs (the Firecracker microVM the
project is developed on) it is far more, and the guest's CPU accounting never shows it: the
writer thread looks idle while training slows down. This measures that cost where it lands.

A GEMM loop on training's thread count runs while another thread writes `mb` MB as `files`
chunk files through the checkpoint's own write path (`Storage.write_bytes`, O_DIRECT for large
files, then one `Storage.sync`); the peer is the same loop with nothing beside it, timed just
before and just after. `compute_lost_s` is the wall time of the write minus the time the loop
needed for the GEMMs it completed meanwhile, at the peer's rate.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import torch

from cs3ray import direct_io
from cs3ray.errors import UserError
from cs3ray.storage import open_url

from . import stats

JSON_KEYS = ["write_mb", "files", "threads", "repeats", "write_s", "writer_cpu_s", "compute_lost_s",
             "compute_lost_s_interval", "compute_lost_s_rounds", "compute_lost_s_per_gb", "lost_over_writer_cpu",
             "lost_over_writer_cpu_interval", "lost_over_writer_cpu_rounds", "gemm_per_s", "targets", "verdicts",
             "method"]
_GEMM = 1024  # ~2 GFLOP per product: short enough to count finely, big enough to use every thread


def _gemm_rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        n += 1
    return n / (time.perf_counter() - t0)


def _write(folder: str, data: Any, files: int, out: dict[str, float]) -> None:
    """Write `data` as `files` chunk files the way a checkpoint does; record wall and CPU seconds."""
    cpu0 = time.thread_time()
    try:
        store = open_url(folder)
        per = len(data) // files
        for i in range(files):
            store.write_bytes(data[i * per:(i + 1) * per], f"{i % 256:02x}", f"chunk-{i:05d}", durable=False)
        store.sync()
    except UserError as exc:  # reported by the caller's thread, as one line
        out["error"] = str(exc)
        return
    out["cpu_s"] = time.thread_time() - cpu0


def run(path: str | None = None, mb: int = 512, files: int = 256, repeats: int = 3, threads: int | None = None,
        quick: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Median over `repeats` rounds of the compute lost while `mb` MB are written under `path`, with 95%
    intervals (t on the raw values: the loss may be near zero or below it on a quiet host)."""
    say = log or (lambda m: None)
    if quick:
        mb, files, repeats = min(mb, 64), min(files, 32), 2  # a round of 64 MB is about a second
    if path is not None and not os.path.isdir(path):
        raise UserError(f"--path '{path}' is not an existing folder.")
    threads = threads or torch.get_num_threads()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    base_s = 0.5 if quick else 1.5
    # Page-aligned, like the checkpoint's staging buffers, so large chunks go out with O_DIRECT in place.
    data = direct_io.aligned_empty(mb << 20)
    data.fill(1)
    a, b = torch.randn(_GEMM, _GEMM), torch.randn(_GEMM, _GEMM)
    work = tempfile.mkdtemp(prefix="cs3-bench-disk-", dir=path)
    runs: list[dict[str, float]] = []
    try:
        _gemm_rate(a, b, 0.3)  # warm-up
        for r in range(repeats):
            before = _gemm_rate(a, b, base_s)
            out: dict[str, float] = {}
            folder = os.path.join(work, f"round-{r}")
            writer = threading.Thread(target=_write, args=(folder, data, files, out), name="cs3-bench-disk")
            n, t0 = 0, time.perf_counter()
            writer.start()
            while writer.is_alive():
                torch.mm(a, b)
                n += 1
            wall = time.perf_counter() - t0
            writer.join()
            if "error" in out:
                raise UserError(out["error"])
            after = _gemm_rate(a, b, base_s)
            peer = (before + after) / 2
            lost = wall - n / peer
            runs.append({"write_s": wall, "cpu_s": out["cpu_s"], "lost_s": lost, "rate": peer})
            say(f"round {r + 1}: wrote {mb} MB in {wall:.2f}s, writer CPU {out['cpu_s']:.2f}s, "
                f"GEMM loop lost {lost:.2f}s (peer {peer:.1f} GEMM/s)")
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(old_threads)

    def med(key: str) -> float:
        return float(statistics.median(x[key] for x in runs))
    # Each round's write is paired with the loop alone just before and after it: its figures are per round.
    figures = {**stats.summarize("compute_lost_s", [x["lost_s"] for x in runs], difference=True),
               **stats.summarize("lost_over_writer_cpu", [x["lost_s"] / max(x["cpu_s"], 1e-3) for x in runs],
                                 difference=True)}
    return {"write_mb": mb, "files": files, "threads": threads, "repeats": repeats, "path": path or tempfile.gettempdir(),
            "write_s": med("write_s"), "writer_cpu_s": med("cpu_s"), **figures,
            "compute_lost_s_per_gb": figures["compute_lost_s"] / (mb / 1024), "gemm_per_s": med("rate"),
            "targets": {}, "verdicts": {}, "method": stats.METHOD}


def rows(r: dict) -> list[tuple]:
    """Table rows: medians of the rounds, the paired figures as `median [95% interval]`."""
    return [("write (wall)", "s", r["write_s"]), ("writer thread CPU", "s", r["writer_cpu_s"]),
            ("compute lost beside it", "s", stats.shown(r, "compute_lost_s", 3)),
            ("compute lost per GB", "s", r["compute_lost_s_per_gb"]),
            ("lost / writer CPU", "x", stats.shown(r, "lost_over_writer_cpu")), ("peer GEMM rate", "1/s", r["gemm_per_s"])]
