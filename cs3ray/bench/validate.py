"""`cs3 validate`: the deployment guide's acceptance checklist, measured on the cluster at hand.

Each item is measured, not assumed, and gets PASS or FAIL with its figure and target:
versions and clocks of every node, collective bus bandwidth against the link it runs on,
training MFU against the measured peak, recovery from a killed worker, serving P99
inter-token latency, storage read throughput and random-read IOPS, and Ray's metrics endpoint on
every node; with GPUs, nccl bus bandwidth within a node and across nodes, MFU of a model sized to
the GPU, serving P99 on the GPU and each GPU's health through NVML (cs3ray.bench.validate_gpu).
An item the cluster cannot measure (no GPU, no O_DIRECT, no link to hold it to) is NOT MEASURED
with the reason, never PASS.
A figure measured repeatedly (the collective's paired rounds, MFU's log windows, the serving
replays' p99s, the storage reads) is the median of its rounds with a 95% interval, and its
target a verdict (cs3ray.bench.stats): PASS needs `met`, so a figure whose interval straddles
the target FAILs as `inconclusive` (rerun, or run the default level's more rounds). A single
event (the recovery, the worst clock offset) is judged by its figure.
Levels as DCGM's diagnostics have them: `quick` is a short pass of each (about a minute and a
half on 2 cores), the default measures more sizes, steps, rounds and requests. An item whose
work raised gets FAIL and the error; the others still run.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import os
import platform
import statistics
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any, Callable

from cs3ray.config import load_config
from cs3ray.ops.cluster import ray_cluster
from cs3ray.ops.ports import free_port
from cs3ray.storage import open_url

from . import stats

MIB = 1 << 20
# Targets of the deployment guide's go-live checklist; MFU's is ours (CPU matmul peaks are high).
TARGETS: dict[str, dict[str, float]] = {
    "bw_utilization": {"at_least": 0.8}, "p99_itl_ms": {"at_most": 50.0}, "recovery_s": {"at_most": 300.0},
    "clock_skew_s": {"at_most": 1.0}, "mfu": {"at_least": 0.2}, "read_mb_per_s": {"at_least": 100.0},
    "node_bw_utilization": {"at_least": 0.8}, "gpu_mfu": {"at_least": 0.2}, "gpu_p99_itl_ms": {"at_most": 50.0},
    "read_iops": {"at_least": 500_000.0}}
NOT_MEASURED = "not measured"
NO_GPU = "no GPU on the cluster (Ray reports no GPU resource)"
# Rounds: the collective's paired rounds, the serving replays (`requests` each) and the storage reads.
LEVELS = {
    "quick": {"sizes_mib": [16], "rounds": 3, "steps": 8, "kill_after": 4, "requests": 8, "read_mb": 32,
              "iops_mb": 128, "iops_s": 1.0, "nccl_mib": [64, 512], "gpu_steps": 6},
    "full": {"sizes_mib": [64, 256], "rounds": 5, "steps": 20, "kill_after": 10, "requests": 16, "read_mb": 256,
             "iops_mb": 1024, "iops_s": 3.0, "nccl_mib": [64, 512, 2048], "gpu_steps": 20},
}


@dataclass
class Check:
    """One item of the checklist: PASS or FAIL, the figure measured and the target it was held to; an item
    with a numeric target also names it (`key`), its interval and rounds, and the verdict PASS rests on."""

    name: str
    passed: bool
    figure: float | None
    unit: str
    target: str
    detail: str = ""
    key: str | None = None
    interval: list[float] | None = None
    rounds: list[float] | None = None
    verdict: str | None = None
    bound: dict[str, float] | None = None  # the target as stats states it: {"at_least": x} or {"at_most": x}
    status: str = ""  # "pass", "fail" or "not measured" (never passed)

    def __post_init__(self) -> None:
        if not self.status:
            self.status = "pass" if self.passed else "fail"


def not_measured(name: str, unit: str, target: str, why: str, key: str | None = None,
                 bound: dict[str, float] | None = None) -> Check:
    """An item the cluster cannot measure: not passed, no figure, the reason; a keyed one's verdict says so."""
    return Check(name, False, None, unit, target, f"not measured: {why}", key, [math.nan, math.nan] if key else None,
                 [] if key else None, NOT_MEASURED if key else None, bound, NOT_MEASURED)


def _unmeasured(name: str, unit: str, key: str, target: dict[str, float], why: str) -> Check:
    return not_measured(name, unit, f"{stats.stated(target)} {unit}", why, key, target)


def _error(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"error: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")


def _check(name: str, unit: str, target: str, measure: Callable[[], tuple[bool, float | None, str]]) -> Check:
    try:
        passed, figure, detail = measure()
    except Exception as exc:  # noqa: BLE001 - the item fails with its error; the checklist goes on
        return Check(name, False, None, unit, target, _error(exc))
    return Check(name, passed, figure, unit, target, detail)


def judged(name: str, unit: str, key: str, target: dict[str, float], rounds: list[float], detail: str,
           difference: bool = True) -> Check:
    """An item held to a numeric target: the median of its rounds with a 95% interval (one round: an event,
    taken as measured), PASS when the verdict is `met`."""
    rounds = [x for x in rounds if math.isfinite(x)]
    if not rounds:
        return _failed(name, unit, key, target, detail + "; no round measured a figure")
    fig = stats.exact(key, rounds[0]) if len(rounds) == 1 else stats.summarize(key, rounds, difference=difference)
    verdict = stats.judge(fig, {key: target})[key]
    if verdict == stats.INCONCLUSIVE:
        detail += "; inconclusive: the interval straddles the target (rerun, or the default level's more rounds)"
    return Check(name, verdict == stats.MET, fig[key], unit, f"{stats.stated(target)} {unit}", detail, key,
                 fig[f"{key}_interval"], fig[f"{key}_rounds"], verdict, target)


def _judged_check(name: str, unit: str, key: str, target: dict[str, float],
                  measure: Callable[[], tuple[list[float], str]], difference: bool = True) -> Check:
    """`judged` of what `measure` returns (its rounds and what it measured); its error FAILs the item."""
    try:
        rounds, detail = measure()
    except Exception as exc:  # noqa: BLE001 - the item fails with its error; the checklist goes on
        return _failed(name, unit, key, target, _error(exc))
    return judged(name, unit, key, target, rounds, detail, difference)


def _failed(name: str, unit: str, key: str, target: dict[str, float], why: str) -> Check:
    """An item held to a numeric target whose work failed: FAIL, nothing measured, inconclusive."""
    return Check(name, False, None, unit, f"{stats.stated(target)} {unit}", why, key, [math.nan, math.nan], [],
                 stats.INCONCLUSIVE, target)


def _node_actor():
    import ray

    @ray.remote(num_cpus=0)
    class NodeProbe:
        """Versions and clock of the node it runs on, and one rank of the collective test."""

        def facts(self) -> dict[str, Any]:
            import torch

            return {"ray": ray.__version__, "torch": torch.__version__, "python": platform.python_version(),
                    "cs3ray": importlib.metadata.version("cs3ray"), "node": ray.get_runtime_context().get_node_id()}

        def now(self) -> float:
            return time.time()

        def address(self) -> tuple[str, int]:
            from cs3ray.ops.ports import free_port

            return ray.util.get_node_ip_address(), free_port()  # where the other rank finds this one

        def collective(self, rank: int, master: str, port: int, sizes_mib: list[int], rounds: int) -> dict[str, Any]:
            """Per size, the point-to-point and all-reduce seconds of each paired round (the slower rank's)."""
            import torch
            import torch.distributed as dist

            from .comm_rank import paired

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2)
            try:
                out = {}
                for mib in sizes_mib:
                    x = torch.randn(mib * MIB // 4)
                    y = torch.empty_like(x)

                    def p2p(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                        recv = dist.irecv(y, 1 - rank)
                        send = dist.isend(x, 1 - rank)
                        send.wait()
                        recv.wait()
                    out[str(mib)] = paired({"p2p_s": p2p, "reduce_s": lambda y=y: dist.all_reduce(y)}, rounds)
                return out
            finally:
                dist.destroy_process_group()

    return NodeProbe


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _versions_and_clocks(probes: dict[str, Any]) -> tuple[Check, Check]:
    import ray

    facts = {node: ray.get(p.facts.remote()) for node, p in probes.items()}
    keys = ("ray", "torch", "cs3ray", "python")
    differ = [k for k in keys if len({f[k] for f in facts.values()}) > 1]
    first = next(iter(facts.values()))
    versions = Check("versions", not differ, float(len(facts)), "nodes", "same Ray, torch, cs3ray and Python on every node",
                     ("differ: " + ", ".join(f"{k} {sorted({f[k] for f in facts.values()})}" for k in differ)) if differ
                     else ", ".join(f"{k} {first[k]}" for k in keys))
    skews = []
    for p in probes.values():
        samples = []
        for _ in range(5):  # the sample with the shortest round trip bounds the offset best
            t0 = time.time()
            there = ray.get(p.now.remote())
            t1 = time.time()
            samples.append((t1 - t0, there - (t0 + t1) / 2))
        skews.append(abs(min(samples)[1]))
    clock = judged("clock", "s", "clock_skew_s", TARGETS["clock_skew_s"], [max(skews)],
                   f"{len(skews)} nodes, the worst offset from the driver's clock")
    return versions, clock


def _collective(nodes: list[str], level: dict[str, Any], link_gbps: float | None,
                extra: dict[str, Any]) -> tuple[list[float], str]:
    """gloo between two CPU ranks: the worst size's busbw over the named link, or over point-to-point both ways
    when none is named, per paired round (the worst: lowest median), and what was run."""
    import ray

    from .comm import busbw_gbps, gbps

    NodeProbe = _node_actor()
    pair = [nodes[0], nodes[1 if len(nodes) > 1 else 0]]  # two nodes when there are two: the link between them
    ranks = [NodeProbe.options(num_cpus=1, scheduling_strategy=_on(n)).remote() for n in pair]
    try:
        master, port = ray.get(ranks[0].address.remote())
        rows = ray.get([r.collective.remote(i, master, port, level["sizes_mib"], level["rounds"])
                        for i, r in enumerate(ranks)])
    finally:
        for r in ranks:
            ray.kill(r)
    sizes = rows[0]
    util = {mib: [busbw_gbps(int(mib) * MIB, r, 2) / (link_gbps or gbps(int(mib) * MIB, p))
                  for p, r in zip(s["p2p_s"], s["reduce_s"], strict=True)] for mib, s in sizes.items()}
    worst = min(util, key=lambda m: statistics.median(util[m]))
    where = "across two nodes" if pair[0] != pair[1] else "within one node (the cluster has one)"
    nbytes, s = int(worst) * MIB, sizes[worst]
    busbw, p2p = busbw_gbps(nbytes, statistics.median(s["reduce_s"]), 2), gbps(nbytes, statistics.median(s["p2p_s"]))
    extra.update(collective_busbw_gbps=busbw, link_gbps=link_gbps or p2p,
                 link_source="named" if link_gbps else "point-to-point")
    against = f"the named {link_gbps:g} Gb/s link" if link_gbps else f"{p2p:.2f} Gb/s point-to-point both ways"
    return (util[worst], f"gloo all-reduce busbw {busbw:.2f} Gb/s vs {against}, {where}, "
            f"{level['rounds']} paired rounds, worst of {', '.join(f'{m} MiB' for m in sizes)}")


def _nccl_across(gpus: dict[str, int], level: dict[str, Any], link_gbps: float | None,
                 extra: dict[str, Any]) -> Check:
    """nccl all-reduce over every GPU of two GPU nodes, over the named link or each rank's share of the
    detected InfiniBand."""
    from .links import named
    from .validate_gpu import nccl_busbw

    key, target = "bw_utilization", TARGETS["bw_utilization"]
    if len(gpus) < 2:
        return _unmeasured("collective_busbw", "of link", key, target,
                           "GPUs on one node only: no link between GPU nodes to measure")
    per_node = min(list(gpus.values())[:2])
    r = nccl_busbw([(node, per_node) for node in list(gpus)[:2]], level["nccl_mib"], level["rounds"])
    link = named(link_gbps) if link_gbps else r["infiniband"]
    extra.update(collective_busbw_gbps=r["median_gbps"], link_gbps=link.gbps if link else None,
                 link_source=link.source if link else None)
    what = (f"nccl all-reduce busbw {r['median_gbps']:,.1f} Gb/s at {r['largest_mib']} MiB, {r['world']} GPUs on "
            f"2 nodes, {level['rounds']} rounds")
    if link is None:
        return _unmeasured("collective_busbw", "of link", key, target,
                           f"{what}; no InfiniBand port found and no --link-gbps named to hold it to")
    return judged("collective_busbw", "of link", key, target, [b / link.gbps for b in r["rounds"]],
                  f"{what}, vs {link.detail}", difference=False)


def _nccl_node(gpus: dict[str, int], level: dict[str, Any], extra: dict[str, Any]) -> Check:
    """nccl all-reduce over the GPUs of the node with the most, over its NVLink."""
    from .validate_gpu import nccl_busbw

    name, unit, key, target = "nccl_busbw_node", "of NVLink", "node_bw_utilization", TARGETS["node_bw_utilization"]
    if not gpus:
        return _unmeasured(name, unit, key, target, NO_GPU)
    node, n = next(iter(gpus.items()))
    if n < 2:
        return _unmeasured(name, unit, key, target, "one GPU per node: no collective within a node")
    r = nccl_busbw([(node, n)], level["nccl_mib"], level["rounds"])
    link = r["nvlink"]
    extra.update(node_busbw_gbps=r["median_gbps"], nvlink_gbps=link.gbps if link else None)
    what = f"nccl all-reduce busbw {r['median_gbps']:,.1f} Gb/s at {r['largest_mib']} MiB, {n} GPUs of one node"
    if link is None:
        return _unmeasured(name, unit, key, target, f"{what}; no active NVLink (nvidia-smi nvlink -s) to hold it to")
    return judged(name, unit, key, target, [b / link.gbps for b in r["rounds"]], f"{what}, vs {link.detail}",
                  difference=False)


def _gpu_mfu(gpus: dict[str, int], level: dict[str, Any], min_mfu: float) -> Check:
    from .validate_gpu import training_mfu

    target = {"at_least": min_mfu}
    if not gpus:
        return _unmeasured("gpu_training_mfu", "of peak", "gpu_mfu", target, NO_GPU)
    r = training_mfu(next(iter(gpus)), level["gpu_steps"])
    return judged("gpu_training_mfu", "of peak", "gpu_mfu", target, r["mfu"],
                  f"{r['model']}, bf16, batch {r['batch']} x {r['seq_len']} tokens on one {r['device']}, "
                  f"measured bf16 peak {r['peak_tflops']:,.0f} TFLOP/s, {len(r['mfu'])} steps")


def _gpu_health(gpus: dict[str, int]) -> Check:
    from .nvml_health import faults, summary
    from .validate_gpu import health

    name, unit, target = "gpu_health", "GPUs", "no uncorrected ECC error, below slowdown temperature, clocks not held down"
    if not gpus:
        return not_measured(name, unit, target, NO_GPU)
    read = health(list(gpus))
    unread = {node: why for node, why in read.items() if isinstance(why, str)}
    devices = [d for found in read.values() if not isinstance(found, str) for d in found]
    bad = [f"{node[:8]} GPU {d['index']}: {'; '.join(faults(d))}" for node, found in read.items()
           if not isinstance(found, str) for d in found if faults(d)]
    if bad:
        return Check(name, False, float(len(devices)), unit, target, "; ".join(bad))
    if unread:
        return not_measured(name, unit, target, f"{len(unread)} of {len(read)} GPU nodes unread: "
                            f"{next(iter(unread.values()))}")
    worst = max(devices, key=lambda d: d["temperature_c"] or 0)
    return Check(name, True, float(len(devices)), unit, target,
                 f"{len(devices)} GPUs on {len(read)} nodes healthy; hottest {summary(worst)}")


def _iops(locations: dict[str, str], level: dict[str, Any]) -> Check:
    """Random 4 KiB O_DIRECT reads per second on each local location; the worst judged; a location that cannot
    be measured leaves the item NOT MEASURED unless a measured one fails."""
    from . import iops

    name, unit, key, target = "storage_iops", "reads/s", "read_iops", TARGETS["read_iops"]
    measured, skipped = {}, []
    for role, where in locations.items():
        if "://" in where and not where.startswith("file://"):
            skipped.append(f"{role} {where}: O_DIRECT needs a local filesystem")
            continue
        try:
            measured[role] = iops.measure(where.removeprefix("file://"), level["iops_mb"], level["iops_s"],
                                          level["rounds"])
        except iops.Unmeasurable as exc:
            skipped.append(f"{role}: {exc}")
    if not measured:
        return _unmeasured(name, unit, key, target, "; ".join(skipped))
    role = min(measured, key=lambda k: statistics.median(measured[k][0]))
    others = [f"{k} {statistics.median(r):,.0f}/s" for k, (r, _) in measured.items() if k != role]
    check = judged(name, unit, key, target, measured[role][0], f"{role} (the slowest): {measured[role][1]}"
                   + (f"; {', '.join(others)}" if others else ""))
    if skipped and check.passed:
        return Check(**{**asdict(check), "passed": False, "status": NOT_MEASURED,
                        "detail": f"{check.detail}; not measured: {'; '.join(skipped)}"})
    if skipped:
        check.detail += f"; not measured: {'; '.join(skipped)}"
    return check


def _train_and_recover(root: str, level: dict[str, Any], min_mfu: float) -> tuple[Check, Check, str]:
    from cs3ray.train.driver import train

    from .recovery import in_thread, joined, kill_once

    run_dir = os.path.join(root, "validate-run")
    # The tiny preset on the standard library's source: needs no file of the user's, runs from any folder.
    cfg = load_config(None, [
        "model.preset=tiny", "data.source=python-stdlib", "train.seq_len=128", "train.lr=3e-3", "train.warmup_steps=2",
        f"run.dir={run_dir}", "run.name=cs3-validate", f"train.steps={level['steps']}", "checkpoint.every=2",
        "train.log_every=1", "train.eval_every=100000", "train.eval_batches=1", "train.batch_size=8",
        "cluster.workers=2", "cluster.max_failures=2", "data.max_bytes=400000", "checkpoint.keep=2"])
    seen: list[dict] = []
    runner, out = in_thread(lambda: train(cfg, on_event=seen.append, quiet=True))
    try:
        m = kill_once(lambda: list(seen), level["kill_after"], 300)
    except TimeoutError:
        if "error" in out:
            raise out["error"] from None
        raise
    joined(runner, out, 600, "the validation run")
    before = [e for e in seen if e["event"] == "progress" and e["wall"] < m["killed"]]
    steady = before[1:] or before  # the first window holds start-up
    recovery = m["first"]["wall"] - m["killed"]
    return (judged("training_mfu", "of peak", "mfu", {"at_least": min_mfu}, [e["mfu"] for e in steady],
                   f"tiny model, 2 workers, {statistics.mean(e['tokens_per_s'] for e in steady):,.0f} tokens/s, "
                   f"{len(steady)} log windows before the kill"),
            judged("recovery", "s", "recovery_s", TARGETS["recovery_s"], [recovery],
                   f"SIGKILL of a worker at step {m['last_before']}: training again from the step-"
                   f"{next(e['step'] for e in seen if e['event'] == 'restored' and e['wall'] > m['killed'])} snapshot"),
            run_dir)


def _serve(run_dir: str, level: dict[str, Any], gpu: bool = False) -> tuple[list[float], str]:
    """Each replay's P99 inter-token latency (ms): the same seeded workload `rounds` times, on a replica holding a
    GPU (the built-in engine on cuda) when `gpu`."""
    from cs3ray.serve.deploy import deploy, make_spec, shutdown

    from .serve_load import replay, summarize, workload

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up lines are not the checklist's
    spec = make_spec(run_dir, name="cs3-validate", overrides={"max_batch": 8, "num_gpus": 1 if gpu else None})
    url = deploy(spec, "127.0.0.1", free_port())
    items = workload(level["requests"], rate=8.0, seed=0, output_tokens=(24, 48))
    try:
        r = summarize([replay(url, spec.name, items) for _ in range(level["rounds"])])
    finally:
        shutdown(spec.name)
    if r["errors"]:
        raise RuntimeError(f"{r['errors']} of {r['requests']} requests failed: {r['first_error']}")
    return (r["replay_p99_itl_ms"], f"{'on one GPU, ' if gpu else ''}{level['rounds']} replays of {level['requests']} streamed requests at 8/s, "
            f"{r['tokens_per_s']:,.0f} tokens/s, p50 {r['p50_itl_ms']:.1f} ms")


def _storage(url: str, mb: int, rounds: int) -> tuple[list[float], str]:
    """MB/s of each of `rounds` reads of one file written to `url`."""
    folder = open_url(url).child(f".cs3-validate-{os.getpid()}")
    data = os.urandom(mb * MIB)
    rates = []
    try:
        folder.write_bytes(data, "probe.bin")
        del data
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = len(folder.read_bytes("probe.bin"))
            rates.append(got / MIB / (time.perf_counter() - t0))
    finally:
        folder.rm("probe.bin", missing_ok=True)
        folder.rm(missing_ok=True)
    return rates, f"{mb} MiB read back {rounds} times from {url}"


def _metrics(nodes: list[dict[str, Any]]) -> tuple[bool, float, str]:
    from prometheus_client.parser import text_string_to_metric_families

    counts, cs3 = [], 0
    for n in nodes:
        with urllib.request.urlopen(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics", timeout=10) as r:
            families = [f.name for f in text_string_to_metric_families(r.read().decode())]
        counts.append(sum(1 for name in families if name.startswith("ray_")))
        cs3 += sum(1 for name in families if name.startswith("ray_cs3_"))
    return (min(counts) > 0, float(len(nodes)), f"{min(counts)}+ Ray metric families on each node's endpoint, "
                                                 f"{cs3} of cs3ray's")


def run(address: str | None = None, quick: bool = False, storage: str | None = None, min_mfu: float = TARGETS["mfu"]["at_least"],
        log: Callable[[str], None] = print, link_gbps: float | None = None, cache: str | None = None) -> dict[str, Any]:
    """Every checklist item on the cluster at `address` (default: an embedded one); the JSON-able result.
    link_gbps: the link collective_busbw is held to (default: the detected one, or point-to-point on CPUs);
    cache: the data cache folder whose IOPS are measured besides the checkpoint storage."""
    import ray

    from .validate_gpu import gpu_nodes

    level = LEVELS["quick" if quick else "full"]
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="cs3-validate-") as root, \
            ray_cluster(address, num_cpus=None if address else 8, quiet=True, use_recorded=True):
        nodes = [n for n in ray.nodes() if n["Alive"]]
        gpus, extra = gpu_nodes(nodes), {}
        NodeProbe = _node_actor()
        probes = {n["NodeID"]: NodeProbe.options(scheduling_strategy=_on(n["NodeID"])).remote() for n in nodes}
        log(f"validating a cluster of {len(nodes)} node(s) ({sum(gpus.values())} GPUs), level {'quick' if quick else 'full'}")
        try:
            versions, clock = _versions_and_clocks(probes)
        finally:
            for p in probes.values():
                ray.kill(p)
        checks += [versions, clock]
        if gpus:
            checks.append(_item("collective_busbw", "of link", "bw_utilization", TARGETS["bw_utilization"],
                                lambda: _nccl_across(gpus, level, link_gbps, extra)))
        else:  # a CPU cluster trains over gloo: that is its collective
            checks.append(_judged_check("collective_busbw", "of link" if link_gbps else "of p2p", "bw_utilization",
                                        TARGETS["bw_utilization"], lambda: _collective(
                                            [n["NodeID"] for n in nodes], level, link_gbps, extra), difference=False))
        log(f"  {checks[-1].name}: {checks[-1].detail}")
        checks.append(_item("nccl_busbw_node", "of NVLink", "node_bw_utilization", TARGETS["node_bw_utilization"],
                            lambda: _nccl_node(gpus, level, extra)))
        try:
            mfu, recovery, run_dir = _train_and_recover(root, level, min_mfu)
        except Exception as exc:  # noqa: BLE001 - both items fail with the run's error; serving has no checkpoint
            mfu = _failed("training_mfu", "of peak", "mfu", {"at_least": min_mfu}, _error(exc))
            recovery = _failed("recovery", "s", "recovery_s", TARGETS["recovery_s"], _error(exc))
            run_dir = None
        checks += [mfu, recovery]
        log(f"  training: MFU {mfu.figure}, recovery {recovery.figure} s")
        if run_dir:
            checks.append(_judged_check("serve_p99_itl", "ms", "p99_itl_ms", TARGETS["p99_itl_ms"],
                                        lambda: _serve(run_dir, level)))
        else:
            checks.append(_failed("serve_p99_itl", "ms", "p99_itl_ms", TARGETS["p99_itl_ms"],
                                  "error: no checkpoint to serve (the training run failed)"))
        checks.append(_item("gpu_training_mfu", "of peak", "gpu_mfu", {"at_least": min_mfu},
                            lambda: _gpu_mfu(gpus, level, min_mfu)))
        log(f"  gpu_training_mfu: {checks[-1].detail}")
        if not gpus:
            checks.append(_unmeasured("gpu_serve_p99_itl", "ms", "gpu_p99_itl_ms", TARGETS["gpu_p99_itl_ms"], NO_GPU))
        elif run_dir:
            checks.append(_judged_check("gpu_serve_p99_itl", "ms", "gpu_p99_itl_ms", TARGETS["gpu_p99_itl_ms"],
                                        lambda: _serve(run_dir, level, gpu=True)))
        else:
            checks.append(_failed("gpu_serve_p99_itl", "ms", "gpu_p99_itl_ms", TARGETS["gpu_p99_itl_ms"],
                                  "error: no checkpoint to serve (the training run failed)"))
        checks.append(_item("gpu_health", "GPUs", None, None, lambda: _gpu_health(gpus)))
        checks.append(_judged_check("storage_read", "MB/s", "read_mb_per_s", TARGETS["read_mb_per_s"],
                                    lambda: _storage(storage or root, level["read_mb"], level["rounds"])))
        places = {"checkpoint storage": storage or root} | ({"cache": cache} if cache else {})
        checks.append(_item("storage_iops", "reads/s", "read_iops", TARGETS["read_iops"], lambda: _iops(places, level)))
        log(f"  storage_iops: {checks[-1].detail}")
        checks.append(_check("metrics_endpoint", "nodes", "every node's endpoint parses as Prometheus text",
                             lambda: _metrics(nodes)))
    return {"level": "quick" if quick else "full", "passed": all(c.passed for c in checks),
            "failed": [c.name for c in checks if c.status == "fail"],
            "not_measured": [c.name for c in checks if c.status == NOT_MEASURED],
            "gpus": sum(gpus.values()), "checks": {c.name: asdict(c) for c in checks},
            **{k: extra.get(k) for k in EXTRA_KEYS}, **figures(checks)}


# Top-level figures besides the judged ones: the bus bandwidths in Gb/s and the links they were held to.
EXTRA_KEYS = ("collective_busbw_gbps", "link_gbps", "link_source", "node_busbw_gbps", "nvlink_gbps")


def _item(name: str, unit: str, key: str | None, target: dict[str, float] | None, measure: Callable[[], Check]) -> Check:
    """The Check `measure` builds; its error FAILs the item (with its target, when it has one)."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - the item fails with its error; the checklist goes on
        if key is None:
            return Check(name, False, None, unit, "", _error(exc))
        return _failed(name, unit, key, target, _error(exc))


def figures(checks: list[Check]) -> dict[str, Any]:
    """The numeric targets' figures at top level as every bench has them (`X`, `X_interval`, `X_rounds`), with
    `targets`, `verdicts` and the interval method."""
    keyed = [c for c in checks if c.key]
    out: dict[str, Any] = {}
    for c in keyed:
        out |= {c.key: c.figure, f"{c.key}_interval": c.interval, f"{c.key}_rounds": c.rounds}
    return out | {"targets": {c.key: c.bound for c in keyed}, "verdicts": {c.key: c.verdict for c in keyed}, "method": stats.METHOD}


def _figure(c: dict) -> str:
    """`0.91 [0.88, 0.93] of p2p`; a single event's figure alone; `-` where nothing was measured."""
    if c["figure"] is None:
        return "-"
    low, high = c["interval"] or (math.nan, math.nan)
    shown = f"{c['figure']:,.3g}" if math.isnan(low) or low == high else f"{c['figure']:,.3g} [{low:,.3g}, {high:,.3g}]"
    return f"{shown} {c['unit']}"


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: item, PASS/FAIL/NOT MEASURED, the target's verdict, figure [95% interval], target, what was
    measured."""
    return [(name, c["status"].upper(), c.get("verdict") or "", _figure(c), c["target"], c["detail"])
            for name, c in r["checks"].items()]


COLUMNS = ["item", "result", "verdict", "figure", "target", "measured"]


def markdown(r: dict[str, Any]) -> str:
    """The report `--out FILE` writes: the same table in markdown."""
    outcome = ("FAIL" if r["failed"] else "PASS" if r["passed"]
               else f"no item failed, {len(r['not_measured'])} not measured")
    lines = [f"# cs3 validate ({r['level']}): {outcome}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in rows(r)]
    return "\n".join(lines) + "\n"
