"""`cs3 bench comm --ranks 2,4,8,16`: what each rank sends in a collective as the ranks grow, against its formula.

For each N, N gloo processes on this machine (loopback, small buffers) run four modes once
counted, then timed (cs3ray.bench.comm_scale_rank): gloo's fp32 all-reduce, cs3ray's int8
compressed all-reduce, and FSDP2's reduce-scatter through cs3ray's callables, fp32 (on gloo
cs3ray's point-to-point exchange: gloo's own reduce-scatter is a whole all-reduce, twice the
bytes) and int8 (phase 1 of the compressed all-reduce). What is counted:

- cs3ray's exchanges (the reduce-scatters, int8 all-reduce): the point-to-point bytes and messages
  the rank hands to torch.distributed (send/isend wrapped), what it puts on the wire less gloo's headers.
- gloo's collective (fp32 all-reduce): the payload handed to one call says nothing of what gloo
  sends, so the bytes are what the rank process writes to its sockets during the call
  (/proc/self/io wchar, gloo's 48-byte headers and control messages included), and the
  messages its socket writes (syscw).

Formulas per rank: all-reduce 2(N-1)/N x payload, reduce-scatter (N-1)/N x payload, with the
payload of the int8 modes the tensor encoded whole (codec.wire_bytes(n)). Every mode should stay
within BYTES_TOLERANCE of its formula; the compressed exchanges should send no more messages per
rank than a ring (2(N-1) per piece for the all-reduce, N-1 for the reduce-scatter).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from cs3ray.core.compress.allreduce import PIECE
from cs3ray.core.compress.codec import BLOCK, make_codec
from cs3ray.errors import UserError

from . import comm

NUMEL, QUICK_NUMEL = 256 * 1024, 64 * 1024  # fp32 values: 1 MiB and 256 KiB, small buffers
REPS, QUICK_REPS = 20, 5
MAX_RANKS = 64  # processes on one machine
BYTES_TOLERANCE = 0.10
GLOO_MODES = ("fp32_all_reduce",)  # counted on the sockets, see above
ALL_REDUCE_MODES = ("fp32_all_reduce", "int8_all_reduce")
COLUMNS = ["ranks", "mode", "bytes/rank", "formula", "ratio", "messages/rank", "ring", "ms", "met"]


def parse_ranks(text: str) -> list[int]:
    """`2,4,8,16` -> [2, 4, 8, 16]; UserError (one line) for anything else."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise UserError(f"--ranks takes whole numbers separated by commas, such as 2,4,8,16; got {text!r}")
    ranks = [int(p) for p in parts]
    if any(n < 2 or n > MAX_RANKS for n in ranks):
        raise UserError(f"--ranks: every count must be from 2 to {MAX_RANKS} (processes on this machine); got {text!r}")
    return sorted(set(ranks))


def numel_for(world: int, numel: int) -> int:
    """The buffer rounded up to whole codec blocks per rank, so every rank's chunk is the same."""
    step = world * BLOCK
    return math.ceil(numel / step) * step


def formulas(world: int, numel: int) -> dict[str, dict[str, float | int | None]]:
    """Per mode: bytes per rank by the formula, and a ring's messages per rank (cs3ray's exchanges only)."""
    encoded = make_codec("int8").wire_bytes(numel)
    pieces = math.ceil(numel / world / PIECE)  # int8 chunks go piece by piece past PIECE values
    ar, rs = 2 * (world - 1) / world, (world - 1) / world
    return {"fp32_all_reduce": {"bytes": ar * 4 * numel, "ring_messages": None},
            "int8_all_reduce": {"bytes": ar * encoded, "ring_messages": 2 * (world - 1) * pieces},
            "fsdp_fp32_reduce_scatter": {"bytes": rs * 4 * numel, "ring_messages": world - 1},
            "fsdp_int8_reduce_scatter": {"bytes": rs * encoded, "ring_messages": (world - 1) * pieces}}


def summarize(world: int, numel: int, raw: dict[str, Any]) -> dict[str, Any]:
    """One row of the JSON `ranks` list: per mode, the worst rank's counts next to the formula."""
    modes = {}
    for mode, f in formulas(world, numel).items():
        every = raw["modes"][mode]["ranks"]
        gloo = mode in GLOO_MODES
        sent = max(r["wire_bytes"] if gloo else r["p2p_bytes"] for r in every)
        messages = max(r["write_syscalls"] if gloo else r["p2p_messages"] for r in every)
        ratio = sent / f["bytes"]
        modes[mode] = {
            "bytes_per_rank": sent, "formula_bytes_per_rank": round(f["bytes"]), "bytes_ratio": round(ratio, 4),
            "bytes_met": abs(ratio - 1) <= BYTES_TOLERANCE,
            "messages_per_rank": messages, "ring_messages_per_rank": f["ring_messages"],
            "messages_met": None if f["ring_messages"] is None else messages <= f["ring_messages"],
            "seconds": raw["modes"][mode]["seconds"],
            "counted": "socket writes of the rank process" if gloo else "point-to-point sends handed to torch.distributed",
            "handed_bytes_per_rank": max(r["p2p_bytes"] + r["collective_bytes"] for r in every),
            "wire_bytes_per_rank": max(r["wire_bytes"] for r in every),
            "write_syscalls_per_rank": max(r["write_syscalls"] for r in every)}
    return {"ranks": world, "numel": numel, "modes": modes}


def not_met(rows: list[dict[str, Any]]) -> list[str]:
    """One line per figure off its bound."""
    out = []
    for row in rows:
        for mode, m in row["modes"].items():
            if not m["bytes_met"]:
                out.append(f"{row['ranks']} ranks, {mode}: {m['bytes_ratio']:.2f} x its formula's bytes")
            if m["messages_met"] is False:
                out.append(f"{row['ranks']} ranks, {mode}: {m['messages_per_rank']} messages, a ring's "
                           f"{m['ring_messages_per_rank']}")
    return out


def run(ranks: list[int], quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every rank count in turn; a failed count ends the run with its first error."""
    started = time.perf_counter()
    reps = QUICK_REPS if quick else REPS
    out: list[dict[str, Any]] = []
    for world in ranks:
        numel = numel_for(world, QUICK_NUMEL if quick else NUMEL)
        log(f"{world} ranks: {numel * 4 // 1024} KiB of fp32, {reps} repetitions")
        raw = comm._run_ranks({"numel": numel, "reps": reps}, None, world=world,
                              module="cs3ray.bench.comm_scale_rank")
        if raw.get("first_error"):
            return {"ranks": [{"ranks": world, "modes": {}, **raw}]}
        out.append(summarize(world, numel, raw))
    missed = not_met(out)
    return {"ranks": out, "bytes_tolerance": BYTES_TOLERANCE, "met": not missed, "not_met": missed,
            "reps": reps, "wall_s": round(time.perf_counter() - started, 1)}


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows, one per rank count and mode."""
    out = []
    for row in r["ranks"]:
        for mode, m in row["modes"].items():
            ring = m["ring_messages_per_rank"]
            met = "met" if m["bytes_met"] and m["messages_met"] is not False else "not met"
            out.append((row["ranks"], mode, m["bytes_per_rank"], m["formula_bytes_per_rank"], m["bytes_ratio"],
                        m["messages_per_rank"] if ring is not None else f"({m['messages_per_rank']} writes)",
                        "-" if ring is None else ring, 1000 * m["seconds"], met))
    return out
