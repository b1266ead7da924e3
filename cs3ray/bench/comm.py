"""`cs3 bench comm`: the gradient transports between 2 ranks, on loopback and over an emulated link.

Per size (4..256 MiB of fp32): (a) point-to-point with both directions at once (the link's
limit: the rate in one direction while the other also sends), (b) gloo's fp32 all-reduce,
(c) cs3ray's fp32 two-phase all-reduce, (d) on loopback, the shared-memory intra-node
all-reduce; then (e) each codec's compressed all-reduce at one size (64 MiB), quantization
and error feedback included. All-reduce figures are bus bandwidth as nccl-tests defines it:
algbw (bytes / time) x 2 (n-1) / n. Everything runs twice: between two processes on loopback,
and between two processes in two network namespaces joined by a veth pair shaped to
`--link-gbps` with tc (cs3ray.bench.netns; root and iproute2, else that part is skipped).
The calls compared run in paired rounds (cs3ray.bench.comm_rank.paired), so every ratio is the
median of the rounds' ratios with a 95% interval (cs3ray.bench.stats) and each target a verdict.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from cs3ray.ops.ports import free_port

from . import netns, stats

WORLD = 2
MIB = 1 << 20
SIZES_MIB, QUICK_SIZES_MIB = (4, 16, 64, 256), (4, 16)
CODEC_MIB, QUICK_CODEC_MIB = 64, 16
REPS, QUICK_REPS = 5, 2
CODECS = ("bf16", "int8", "int4_sparse")
RANK_TIMEOUT_S = 480
LINK_PORT = 29400  # any port: the namespaces hold nothing else
# glibc returns freed buffers above its mmap threshold (32 MiB at most) to the kernel, so every
# fresh 64-256 MiB tensor is page-faulted in again: on the VMs of docs/benchmarks.md that, not the
# arithmetic, made most of a codec's cost at 64 MiB. The ranks keep freed memory for reuse instead.
RANK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def gbps(nbytes: float, seconds: float) -> float:
    """Gigabits per second (10^9 bits) of `nbytes` moved in `seconds`."""
    return nbytes * 8 / seconds / 1e9


def busbw_gbps(nbytes: float, seconds: float, world: int) -> float:
    """All-reduce bus bandwidth (nccl-tests): algbw x 2 (n-1) / n, what each rank's link carries."""
    return gbps(nbytes, seconds) * 2 * (world - 1) / world


def _plan(quick: bool, shm: bool) -> dict[str, Any]:
    return {"sizes_mib": list(QUICK_SIZES_MIB if quick else SIZES_MIB), "reps": QUICK_REPS if quick else REPS,
            "codec_mib": QUICK_CODEC_MIB if quick else CODEC_MIB, "codecs": list(CODECS), "shm": shm}


def _run_ranks(plan: dict[str, Any], link: netns.Link | None, world: int = WORLD,
               module: str = "cs3ray.bench.comm_rank") -> dict[str, Any]:
    """Start `world` rank processes of `module` (in the link's namespaces, or on loopback) and return rank 0's
    raw result, or the first rank's error."""
    with tempfile.TemporaryDirectory(prefix="cs3-bench-comm-") as tmp:
        port = LINK_PORT if link else free_port()
        procs, logs = [], []
        for rank in range(world):
            cmd = [*(link.exec_prefix(rank) if link else []), sys.executable, "-m", module,
                   "--rank", str(rank), "--world", str(world), "--addr", netns.ADDRS[0] if link else "127.0.0.1",
                   "--port", str(port), "--ifname", link.dev[rank] if link else "lo", "--plan", json.dumps(plan),
                   "--out", os.path.join(tmp, f"rank{rank}.json")]
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RANK_ENV}))
        deadline = time.monotonic() + RANK_TIMEOUT_S
        timed_out = False
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        errors = []
        for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
            out = os.path.join(tmp, f"rank{rank}.json")
            result = None
            if os.path.exists(out):
                with open(out) as f:
                    result = json.load(f)
            if p.returncode == 0 and (rank or result):
                continue
            if result and result.get("first_error"):
                errors.append(result)
            else:
                log.seek(0)
                lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
                why = f"did not finish in {RANK_TIMEOUT_S} s" if timed_out else f"exited with {p.returncode}"
                errors.append({"first_error": f"rank {rank} {why}" + (f": {lines[-1]}" if lines else "")})
        for log in logs:
            log.close()
        if errors:
            return errors[0]
        with open(os.path.join(tmp, "rank0.json")) as f:
            return json.load(f)


def _per_round(row: dict[str, list[float]], num: str, den: str) -> list[float]:
    """Per round, busbw (or bandwidth) ratio `num` / `den` of one size: den's seconds over num's (the bytes are
    the same; an all-reduce's busbw factor is 2 (n-1) / n, a point-to-point's 1)."""
    factor = {"p2p_bidir_s": 1.0}
    return [factor.get(num, 2 * (WORLD - 1) / WORLD) / factor.get(den, 2 * (WORLD - 1) / WORLD) * d / n
            for n, d in zip(row[num], row[den], strict=True)]


def _worst(by_size: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The size whose median `name` is lowest: its figure, interval and rounds, and which size it was."""
    mib = min(by_size, key=lambda m: by_size[m][name])
    d = by_size[mib]
    return {name: d[name], f"{name}_interval": d[f"{name}_interval"], f"{name}_rounds": d[f"{name}_rounds"],
            f"{name}_size_mib": int(mib)}


def summarize_path(raw: dict[str, Any]) -> dict[str, Any]:
    """Bandwidths per size (of the rounds' median seconds) and each size's busbw_cs3 / p2p_bidir per round; at
    top level the largest size's bandwidths and the worst size's utilization with its interval."""
    by_size: dict[str, dict[str, Any]] = {}
    for mib, row in raw["sizes"].items():
        nbytes = int(mib) * MIB
        d: dict[str, Any] = {"p2p_bidir_gbps": gbps(nbytes, statistics.median(row["p2p_bidir_s"])),
                             "busbw_gloo_gbps": busbw_gbps(nbytes, statistics.median(row["gloo_s"]), WORLD),
                             "busbw_cs3_gbps": busbw_gbps(nbytes, statistics.median(row["cs3_s"]), WORLD)}
        d |= stats.summarize("bw_utilization", _per_round(row, "cs3_s", "p2p_bidir_s"))
        if "shm_s" in row:
            d["busbw_shm_gbps"] = busbw_gbps(nbytes, statistics.median(row["shm_s"]), WORLD)
            d |= stats.summarize("shm_speedup", _per_round(row, "shm_s", "gloo_s"))
        by_size[mib] = d
    largest = by_size[max(by_size, key=int)]
    out: dict[str, Any] = {k: largest[k] for k in ("p2p_bidir_gbps", "busbw_gloo_gbps", "busbw_cs3_gbps")}
    out |= _worst(by_size, "bw_utilization")
    if "busbw_shm_gbps" in largest:
        out["busbw_shm_gbps"] = largest["busbw_shm_gbps"]
        out |= _worst(by_size, "shm_speedup")
    out["by_size"] = by_size
    return out


def codec_speedups(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """Per codec, `<codec>_<path>_speedup`: gloo's fp32 all-reduce time / the codec's, per round (the two timed
    back to back in each round), summarized."""
    codecs = raw["codecs"]
    return {k: v for name in CODECS for k, v in stats.summarize(
        f"{name}_{path}_speedup", [g / c for g, c in zip(codecs["gloo_s"], codecs[name]["s"], strict=True)]).items()}


# Targets: the link's (over --link-gbps) and loopback's, where a codec must at least not cost time.
LINK_TARGETS: dict[str, dict[str, float]] = {"bw_utilization": {"at_least": 0.9},
                                             "int8_link_speedup": {"at_least": 2.5},
                                             "int4_sparse_link_speedup": {"at_least": 6.0}}
LOOPBACK_TARGETS: dict[str, dict[str, float]] = {"shm_speedup": {"at_least": 1.5},
                                                 **{f"{c}_loopback_speedup": {"at_least": 1.0} for c in CODECS}}


def judged(result: dict[str, Any]) -> dict[str, Any]:
    """`targets`, `verdicts` and, where the link part was skipped, `verdict_reasons` (its targets are then
    inconclusive: nothing measured them)."""
    targets = {**LINK_TARGETS, **LOOPBACK_TARGETS}
    verdicts = stats.judge(result, LOOPBACK_TARGETS)
    reasons: dict[str, str] = {}
    if result["link_skipped"]:
        for name in LINK_TARGETS:
            verdicts[name], reasons[name] = stats.INCONCLUSIVE, result["link_skipped"]
    else:
        verdicts |= stats.judge(result, LINK_TARGETS)
    return {"targets": targets, "verdicts": {k: verdicts[k] for k in targets}, "verdict_reasons": reasons,
            "method": stats.METHOD}


def run(quick: bool = False, link_gbps: float = 1.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure on loopback, then over the emulated link (skipped with a reason where it cannot be made)."""
    started = time.perf_counter()
    plan = _plan(quick, shm=True)
    log(f"loopback: 2 ranks, sizes {plan['sizes_mib']} MiB, codecs at {plan['codec_mib']} MiB, {plan['reps']} "
        "paired rounds")
    loop_raw = _run_ranks(plan, None)
    if loop_raw.get("first_error"):
        return {"loopback": loop_raw}
    link_raw: dict[str, Any] | None = None
    skipped = netns.unavailable()
    if skipped is None:
        try:
            with netns.Link(link_gbps) as link:
                log(f"emulated link: namespaces {link.ns[0]}, {link.ns[1]}, veth shaped to {link_gbps:g} Gb/s (tbf)")
                link_raw = _run_ranks(_plan(quick, shm=False), link)
        except RuntimeError as exc:  # the host refused a namespace, veth or qdisc
            skipped = f"the emulated link could not be made ({exc}); skipped"
        if link_raw is not None and link_raw.get("first_error"):
            return {"link": link_raw}
    if skipped:
        log(skipped)
    loopback = summarize_path(loop_raw)
    linked = summarize_path(link_raw) if link_raw else None
    loop_codecs = codec_speedups(loop_raw, "loopback")
    link_codecs = codec_speedups(link_raw, "link") if link_raw else {}
    codecs = {name: {"wire_ratio": loop_raw["codecs"][name]["wire_ratio"],
                     "quant_ms_per_mib": loop_raw["codecs"][name]["quant_ms_per_mib"],
                     "loopback_speedup": loop_codecs[f"{name}_loopback_speedup"],
                     "link_speedup": link_codecs.get(f"{name}_link_speedup")}
              for name in CODECS}
    link_keys = ("p2p_bidir_gbps", "busbw_gloo_gbps", "busbw_cs3_gbps", "bw_utilization", "bw_utilization_interval",
                 "bw_utilization_rounds", "bw_utilization_size_mib",
                 *(f"{c}_link_speedup{s}" for c in CODECS for s in ("", "_interval", "_rounds")))
    link_figures = {**(linked or {}), **link_codecs}
    result = {
        **{k: link_figures.get(k) for k in link_keys},
        "link_gbps": link_gbps if linked else None, "link_skipped": skipped,
        "link_by_size": linked["by_size"] if linked else None,
        "loopback": loopback, **{k: loopback[k] for k in loopback if k.startswith("shm_speedup")}, **loop_codecs,
        "codecs": codecs,
        "ranks": WORLD, "sizes_mib": plan["sizes_mib"], "codec_mib": plan["codec_mib"], "reps": plan["reps"],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return result | judged(result)


def _shown(r: dict[str, Any] | None, name: str) -> str:
    """`0.936 [0.90, 0.95]`, or `-` where the figure was not measured (the link part skipped)."""
    return "-" if r is None or r.get(name) is None else stats.shown(r, name, 3)


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: measure, loopback, emulated link; ratios as median [95% interval] of the paired rounds."""
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"
    lo = r["loopback"]
    out = [(f"{name} (Gb/s)", fmt(lo[key]), fmt(r[key])) for name, key in (
        ("p2p bidirectional, one direction", "p2p_bidir_gbps"), ("busbw gloo fp32", "busbw_gloo_gbps"),
        ("busbw cs3ray fp32", "busbw_cs3_gbps"))]
    out.append(("busbw shared memory (Gb/s)", fmt(lo.get("busbw_shm_gbps")), "-"))
    out.append(("bw utilization (worst size)", _shown(lo, "bw_utilization"), _shown(r, "bw_utilization")))
    out.append(("shm speedup over gloo (worst size)", _shown(r, "shm_speedup"), "-"))
    for name, c in r["codecs"].items():
        out.append((f"{name} speedup at {r['codec_mib']} MiB (wire {c['wire_ratio']:.4f}, "
                    f"{c['quant_ms_per_mib']:.2f} ms/MiB)", _shown(r, f"{name}_loopback_speedup"),
                    _shown(r, f"{name}_link_speedup")))
    return out


def verdict_line(r: dict[str, Any]) -> str:
    """Every target's figure, interval and verdict; a target of a skipped link part says so instead."""
    return "; ".join(f"{k} ({stats.stated(r['targets'][k])}): {v}, link skipped" if k in r["verdict_reasons"]
                     else f"{k} {stats.shown(r, k)} ({stats.stated(r['targets'][k])}): {v}"
                     for k, v in r["verdicts"].items())
