"""`cs3 validate`: the deployment guide's acceptance checklist, measured on the cluster at hand.

Each item is measured, not assumed, and gets PASS or FAIL with its figure and target:
versions and clocks of every node, collective bus bandwidth against the link it runs on,
training MFU against the measured peak, recovery from a killed worker, serving P99
inter-token latency, storage read throughput, and Ray's metrics endpoint on every node.
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
    "clock_skew_s": {"at_most": 1.0}, "mfu": {"at_least": 0.2}, "read_mb_per_s": {"at_least": 100.0}}
# Rounds: the collective's paired rounds, the serving replays (`requests` each) and the storage reads.
LEVELS = {
    "quick": {"sizes_mib": [16], "rounds": 3, "steps": 8, "kill_after": 4, "requests": 8, "read_mb": 32},
    "full": {"sizes_mib": [64, 256], "rounds": 5, "steps": 20, "kill_after": 10, "requests": 16, "read_mb": 256},
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


def _collective(nodes: list[str], level: dict[str, Any]) -> tuple[list[float], str]:
    """The worst size's busbw / point-to-point per paired round (the worst: lowest median), and what was run."""
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
    util = {mib: [busbw_gbps(int(mib) * MIB, r, 2) / gbps(int(mib) * MIB, p)
                  for p, r in zip(s["p2p_s"], s["reduce_s"], strict=True)] for mib, s in sizes.items()}
    worst = min(util, key=lambda m: statistics.median(util[m]))
    where = "across two nodes" if pair[0] != pair[1] else "within one node (the cluster has one)"
    nbytes, s = int(worst) * MIB, sizes[worst]
    return (util[worst],
            f"gloo all-reduce busbw {busbw_gbps(nbytes, statistics.median(s['reduce_s']), 2):.2f} Gb/s vs "
            f"{gbps(nbytes, statistics.median(s['p2p_s'])):.2f} Gb/s point-to-point both ways, {where}, "
            f"{level['rounds']} paired rounds, worst of {', '.join(f'{m} MiB' for m in sizes)}")


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


def _serve(run_dir: str, level: dict[str, Any]) -> tuple[list[float], str]:
    """Each replay's P99 inter-token latency (ms): the same seeded workload `rounds` times."""
    from cs3ray.serve.deploy import deploy, make_spec, shutdown

    from .serve_load import replay, summarize, workload

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up lines are not the checklist's
    spec = make_spec(run_dir, name="cs3-validate", overrides={"max_batch": 8})
    url = deploy(spec, "127.0.0.1", free_port())
    items = workload(level["requests"], rate=8.0, seed=0, output_tokens=(24, 48))
    try:
        r = summarize([replay(url, spec.name, items) for _ in range(level["rounds"])])
    finally:
        shutdown(spec.name)
    if r["errors"]:
        raise RuntimeError(f"{r['errors']} of {r['requests']} requests failed: {r['first_error']}")
    return (r["replay_p99_itl_ms"], f"{level['rounds']} replays of {level['requests']} streamed requests at 8/s, "
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


def run(address: str | None = None, quick: bool = False, storage: str | None = None, min_mfu: float = TARGETS["mfu"],
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every checklist item on the cluster at `address` (default: an embedded one); the JSON-able result."""
    import ray

    level = LEVELS["quick" if quick else "full"]
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="cs3-validate-") as root, \
            ray_cluster(address, num_cpus=None if address else 8, quiet=True, use_recorded=True):
        nodes = [n for n in ray.nodes() if n["Alive"]]
        NodeProbe = _node_actor()
        probes = {n["NodeID"]: NodeProbe.options(scheduling_strategy=_on(n["NodeID"])).remote() for n in nodes}
        log(f"validating a cluster of {len(nodes)} node(s), level {'quick' if quick else 'full'}")
        try:
            versions, clock = _versions_and_clocks(probes)
        finally:
            for p in probes.values():
                ray.kill(p)
        checks += [versions, clock]
        checks.append(_judged_check("collective_busbw", "of p2p", "bw_utilization", TARGETS["bw_utilization"],
                                    lambda: _collective([n["NodeID"] for n in nodes], level), difference=False))
        log(f"  {checks[-1].name}: {checks[-1].detail}")
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
        checks.append(_judged_check("storage_read", "MB/s", "read_mb_per_s", TARGETS["read_mb_per_s"],
                                    lambda: _storage(storage or root, level["read_mb"], level["rounds"])))
        checks.append(_check("metrics_endpoint", "nodes", "every node's endpoint parses as Prometheus text",
                             lambda: _metrics(nodes)))
    return {"level": "quick" if quick else "full", "passed": all(c.passed for c in checks),
            "checks": {c.name: asdict(c) for c in checks}, **figures(checks)}


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
    """Table rows: item, PASS/FAIL, the target's verdict, figure [95% interval], target, what was measured."""
    return [(name, "PASS" if c["passed"] else "FAIL", c.get("verdict") or "", _figure(c), c["target"], c["detail"])
            for name, c in r["checks"].items()]


COLUMNS = ["item", "result", "verdict", "figure", "target", "measured"]


def markdown(r: dict[str, Any]) -> str:
    """The report `--out FILE` writes: the same table in markdown."""
    lines = [f"# cs3 validate ({r['level']}): {'PASS' if r['passed'] else 'FAIL'}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in rows(r)]
    return "\n".join(lines) + "\n"
