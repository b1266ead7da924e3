"""One rank of `cs3 bench comm`: `python -m cs3ray.bench.comm_rank ...`, started by cs3ray.bench.comm.

A plain process (inside a network namespace for the emulated link) so that gloo's traffic takes
the path under test. Every timing is the slower rank's (both start after a barrier). The calls
compared with each other run in paired rounds: each round times every one of them back to back,
in the other order the next round, after one untimed warm-up call each, so a ratio can be taken
per round and a drifting host hits both sides alike. Rank 0 writes the JSON result (each call's
seconds per round) to --out; a rank that fails writes its error there and exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from cs3ray.core.compress import CompressedAllReduce, ShmAllReduce, make_codec
from cs3ray.core.compress.codec import Codec

MIB = 1 << 20


def _slower_rank_s(fn: Callable[[], Any]) -> float:
    """Seconds of one call of `fn` on the slower rank (both start after a barrier)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def paired(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds of each of `fns` per round, `reps` rounds after one warm-up call each: a round times all of
    them back to back, in the opposite order to the round before (both ranks keep the same order)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(reps):
        for name in (list(fns) if i % 2 == 0 else list(reversed(fns))):
            times[name].append(_slower_rank_s(fns[name]))
    return times


def _encode_ms_per_mib(name: str, x: torch.Tensor, reps: int) -> float:
    """This rank's median time to encode x with the codec, per MiB of fp32 input (one thread)."""
    codec = make_codec(name)
    codec.encode(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        codec.encode(x)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times) / (x.numel() * 4 / MIB)


def _measure_size(mib: int, reps: int, shm: bool) -> dict[str, list[float]]:
    """Seconds per round of (a) point-to-point both ways, (b) gloo's, (c) cs3ray's fp32 all-reduce, (d) shared
    memory."""
    rank = dist.get_rank()
    peer = 1 - rank
    x = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(rank))
    y, z = torch.empty_like(x), x.clone()

    def p2p() -> None:
        # The receive first: gloo moves one direction at a time when both sides send before receiving.
        recv = dist.irecv(y, peer)
        send = dist.isend(x, peer)
        send.wait()
        recv.wait()
    fp32 = CompressedAllReduce(Codec(), error_feedback=False)
    fns = {"p2p_bidir_s": p2p, "gloo_s": lambda: dist.all_reduce(z), "cs3_s": lambda: fp32("fp32", x, out=y)}
    local = ShmAllReduce() if shm else None
    if local is not None:
        fns["shm_s"] = lambda: local(x, out=y)
    try:
        return paired(fns, reps)
    finally:
        if local is not None:
            local.close()


def _measure_codecs(names: list[str], x: torch.Tensor, reps: int) -> dict[str, Any]:
    """Per round, gloo's fp32 all-reduce of x and each codec's compressed all-reduce of it (`gloo_s`, and per
    codec `s`), with each codec's wire ratio and encode cost."""
    world = dist.get_world_size()
    z, y = x.clone(), torch.empty_like(x)
    # With error feedback, as training runs it: its residual arithmetic is part of the cost.
    reduces = {name: CompressedAllReduce(make_codec(name), error_feedback=True) for name in names}
    fns: dict[str, Callable[[], Any]] = {"gloo_s": lambda: dist.all_reduce(z)}
    for name, reduce in reduces.items():
        fns[name] = functools.partial(reduce, name, x, out=y)
    times = paired(fns, reps)
    out: dict[str, Any] = {"gloo_s": times["gloo_s"]}
    for name, reduce in reduces.items():
        expected = (reps + 1) * 2 * (world - 1) * make_codec(name).wire_bytes(-(-x.numel() // world))
        if reduce.stats.bytes_sent != expected:  # the codec did not send what it should have
            raise RuntimeError(f"codec {name} sent {reduce.stats.bytes_sent} bytes, expected {expected}")
        out[name] = {"s": times[name], "wire_ratio": reduce.stats.wire_ratio,
                     "quant_ms_per_mib": _encode_ms_per_mib(name, x, reps)}
    return out


def measure(plan: dict[str, Any]) -> dict[str, Any]:
    """Every measurement of the plan on this rank: seconds per size and round, and at plan['codec_mib'] per
    round gloo's fp32 all-reduce beside each codec's (`codecs`: `gloo_s`, then one entry per codec)."""
    out: dict[str, Any] = {"sizes": {}}
    for mib in plan["sizes_mib"]:
        reps = plan["reps"] if mib < 256 else max(1, plan["reps"] - 1)
        out["sizes"][str(mib)] = _measure_size(mib, reps, plan["shm"])
    x = torch.randn(plan["codec_mib"] * MIB // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    out["codecs"] = _measure_codecs(plan["codecs"], x, plan["reps"])
    return out


def main(argv: list[str] | None = None, measure: Callable[[dict[str, Any]], dict[str, Any]] = measure) -> int:
    """Join the gloo group, run `measure` on the plan, write the result (rank 0) or the error."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ifname", required=True)
    ap.add_argument("--plan", required=True, help="the measurements, as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR=args.addr, MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME=args.ifname)
    torch.set_num_threads(1)  # one core per rank, like the training workers on this host
    try:
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
        try:
            result = measure(json.loads(args.plan))
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - handed to the parent as this rank's first_error
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        with open(args.out, "w") as f:
            json.dump({"first_error": f"rank {args.rank}: {type(exc).__name__}: {lines[0] if lines else ''}",
                       "traceback": traceback.format_exc()}, f)
        return 1
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
