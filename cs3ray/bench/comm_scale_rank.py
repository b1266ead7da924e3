"""One rank of `cs3 bench comm --ranks`: `python -m cs3ray.bench.comm_scale_rank ...`, started by
cs3ray.bench.comm_scale (the arguments of cs3ray.bench.comm_rank).

Per mode, one call is counted twice over: what the rank hands to torch.distributed (its
send/isend and collective functions are wrapped for that call: bytes and calls) and what the
process writes to its sockets meanwhile (/proc/self/io: wchar and syscw, gloo's headers and
control messages included). No other traffic runs in that window (the barriers around it are
outside it). Then the call is timed like every `bench comm` figure. Rank 0 writes every
rank's counts and the times.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from cs3ray.core.compress import CompressedAllReduce, make_codec
from cs3ray.core.compress.fsdp import CompressedReduceScatter, PlainReduceScatter
from cs3ray.core.compress.hook import CompressionHook
from cs3ray.core.memory import payload_bytes

from . import comm_rank

# torch.distributed functions that move data, and the position of the argument holding what the caller hands
# over (or its keyword, one of INPUT_KEYWORDS).
POINT_TO_POINT = {"send": 0, "isend": 0}
COLLECTIVES = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
               "reduce_scatter": 1, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_to_all": 1,
               "all_to_all_single": 1, "gather": 0, "scatter": 1}
INPUT_KEYWORDS = ("tensor", "input", "input_tensor", "input_tensor_list", "input_list", "scatter_list")
MODES = ("fp32_all_reduce", "int8_all_reduce", "fsdp_fp32_reduce_scatter", "fsdp_int8_reduce_scatter")


@dataclass
class Counts:
    """What one rank handed to torch.distributed in a window, and what its process wrote to sockets."""

    p2p_bytes: int = 0
    p2p_messages: int = 0
    collective_bytes: int = 0  # the payload handed to gloo's own collectives (not what they send)
    collective_calls: int = 0
    wire_bytes: int = 0  # /proc/self/io wchar: every byte the process wrote (only sockets write in the window)
    write_syscalls: int = 0  # /proc/self/io syscw


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """Count every send and collective handed to torch.distributed, and the process's writes, in the block.

    Callers look the functions up on the module at call time (`dist.isend(...)`), so replacing the
    module's attributes sees every call, cs3ray's codecs' included.
    """
    counts = Counts()
    saved: dict[str, Callable[..., Any]] = {}

    def wrap(name: str, index: int, p2p: bool) -> Callable[..., Any]:
        real = saved[name] = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            handed = args[index] if len(args) > index else next((kwargs[k] for k in INPUT_KEYWORDS if k in kwargs), None)
            payload = payload_bytes(handed)
            if p2p:
                counts.p2p_bytes += payload
                counts.p2p_messages += 1
            else:
                counts.collective_bytes += payload
                counts.collective_calls += 1
            return real(*args, **kwargs)
        return counted

    for table, p2p in ((POINT_TO_POINT, True), (COLLECTIVES, False)):
        for name, index in table.items():
            if hasattr(dist, name):
                setattr(dist, name, wrap(name, index, p2p))
    before = _proc_io()
    try:
        yield counts
    finally:
        after = _proc_io()
        counts.wire_bytes, counts.write_syscalls = after["wchar"] - before["wchar"], after["syscw"] - before["syscw"]
        for name, real in saved.items():
            setattr(dist, name, real)


def _calls(numel: int) -> dict[str, Callable[[], Any]]:
    """Each mode as one call on this rank's fresh inputs."""
    world = dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    fp32, out, shard = x.clone(), torch.empty_like(x), torch.empty(numel // world)
    int8 = CompressedAllReduce(make_codec("int8"), error_feedback=True)  # as training runs it
    # FSDP2's reduce-scatter through cs3ray's callables, as training installs them: fp32 (on gloo cs3ray's
    # point-to-point exchange) and int8.
    fsdp_fp32 = PlainReduceScatter(dist.group.WORLD)
    fsdp_int8 = CompressedReduceScatter(CompressionHook("int8", warmup_steps=0), "layer", fsdp_fp32)
    return {"fp32_all_reduce": lambda: dist.all_reduce(fp32),
            "int8_all_reduce": lambda: int8("grads", x, out=out),
            "fsdp_fp32_reduce_scatter": lambda: fsdp_fp32(shard, x, dist.group.WORLD, dist.ReduceOp.AVG),
            "fsdp_int8_reduce_scatter": lambda: fsdp_int8(shard, x, dist.group.WORLD, dist.ReduceOp.AVG)}


def measure(plan: dict[str, Any]) -> dict[str, Any]:
    """Per mode: every rank's counts for one call (after a warm-up call), and the call's median seconds."""
    out: dict[str, Any] = {"modes": {}}
    for mode, call in _calls(plan["numel"]).items():
        call()
        dist.barrier()
        with counting() as counts:
            call()
        dist.barrier()
        every: list[dict[str, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, asdict(counts))
        seconds = comm_rank.paired({mode: call}, plan["reps"])[mode]  # the slower rank's, per repetition
        out["modes"][mode] = {"ranks": every, "seconds": statistics.median(seconds)}
    return out


if __name__ == "__main__":
    sys.exit(comm_rank.main(measure=measure))
