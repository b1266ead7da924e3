"""Spawn a few ranks in-process (gloo) for tests where Ray is not what is under test."""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
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


def _gloo_entry(rank: int, world: int, port: int, body: Callable[..., None], *args: Any) -> None:
    """One rank: a gloo process group on one thread around `body`; its failure becomes results["error"]."""
    *args, out = args
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[Any, Any] = {}
    try:
        body(rank, world, results, *args)
    except Exception:  # noqa: BLE001 - reported to the parent
        results["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    out.put((rank, results))


def gloo_ranks(body: Callable[..., None], world: int, *args: Any, timeout: float = 300.0) -> dict[int, dict]:
    """Run `body(rank, world, results, *args)` in `world` spawned gloo ranks (one thread each); {rank: results}.

    `body` (a module-level function) fills its `results` dict; an exception lands in results["error"]
    as a traceback, for the test to show.
    """
    return spawn_ranks(_gloo_entry, world, body, *args, timeout=timeout)
