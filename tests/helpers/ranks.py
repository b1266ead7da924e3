"""Spawn a few ranks in-process (gloo) for tests where Ray is not what is under test."""

from __future__ import annotations

import queue
import time
from typing import Any, Callable

import torch.multiprocessing as mp

from cs3ray.ops.ports import free_port


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 300.0) -> dict[int, Any]:
    """Run `target(rank, world, port, *args, out)` in `world` spawned processes; each puts (rank, result)
    on `out`. Returns {rank: result}; a rank that dies before reporting fails the test with the exit codes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, result = out.get(timeout=1)
            results[rank] = result
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):  # died before reporting
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert len(results) == world, f"ranks did not all report: exit codes {[p.exitcode for p in procs]}"
    return results
