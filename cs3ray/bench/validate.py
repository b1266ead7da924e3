"""`cs3 validate`: the deployment guide's acceptance checklist, measured on the cluster at hand.

Each item is measured, not assumed, and gets PASS or FAIL with its figure and target:
versions and clocks of every node, collective bus bandwidth against the link it runs on,
training MFU against the measured peak, recovery from a killed worker, serving P99
inter-token latency, storage read throughput, and Ray's metrics endpoint on every node.
Levels as DCGM's diagnostics have them: `quick` is a short pass of each (about a minute and a
half on 2 cores), the default measures more sizes, steps and requests. An item whose work
raised gets FAIL and the error; the others still run.
"""

from __future__ import annotations

import importlib.metadata
import logging
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

MIB = 1 << 20
# Targets of the deployment guide's go-live checklist; MFU's is ours (CPU matmul peaks are high).
TARGETS = {"bw_utilization": 0.8, "p99_itl_ms": 50.0, "recovery_s": 300.0, "clock_skew_s": 1.0,
           "mfu": 0.2, "read_mb_per_s": 100.0}
LEVELS = {
    "quick": {"sizes_mib": [16], "reps": 3, "steps": 8, "kill_after": 4, "requests": 8, "read_mb": 32},
    "full": {"sizes_mib": [64, 256], "reps": 5, "steps": 20, "kill_after": 10, "requests": 32, "read_mb": 256},
}


@dataclass
class Check:
    """One item of the checklist: its verdict, the figure measured and the target it was held to."""

    name: str
    passed: bool
    figure: float | None
    unit: str
    target: str
    detail: str = ""


def _error(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"error: {type(exc).__name__}" + (f": {lines[0]}" if lines else "")


def _check(name: str, unit: str, target: str, measure: Callable[[], tuple[bool, float | None, str]]) -> Check:
    try:
        passed, figure, detail = measure()
    except Exception as exc:  # noqa: BLE001 - the item fails with its error; the checklist goes on
        return Check(name, False, None, unit, target, _error(exc))
    return Check(name, passed, figure, unit, target, detail)


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

        def collective(self, rank: int, master: str, port: int, sizes_mib: list[int], reps: int) -> dict[str, Any]:
            import torch
            import torch.distributed as dist

            from .comm import busbw_gbps, gbps
            from .comm_rank import timed

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
                    nbytes = x.numel() * 4
                    p2p_s, reduce_s = timed(p2p, reps), timed(lambda y=y: dist.all_reduce(y), reps)
                    out[str(mib)] = {"p2p_bidir_gbps": gbps(nbytes, p2p_s), "busbw_gbps": busbw_gbps(nbytes, reduce_s, 2)}
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
    worst = max(skews)
    clock = Check("clock", worst <= TARGETS["clock_skew_s"], worst, "s", f"<= {TARGETS['clock_skew_s']:g} s from the driver",
                  f"{len(skews)} nodes")
    return versions, clock


def _collective(nodes: list[str], level: dict[str, Any]) -> tuple[bool, float, str]:
    import ray

    NodeProbe = _node_actor()
    pair = [nodes[0], nodes[1 if len(nodes) > 1 else 0]]  # two nodes when there are two: the link between them
    ranks = [NodeProbe.options(num_cpus=1, scheduling_strategy=_on(n)).remote() for n in pair]
    try:
        master, port = ray.get(ranks[0].address.remote())
        rows = ray.get([r.collective.remote(i, master, port, level["sizes_mib"], level["reps"]) for i, r in enumerate(ranks)])
    finally:
        for r in ranks:
            ray.kill(r)
    sizes = rows[0]
    util = {mib: s["busbw_gbps"] / s["p2p_bidir_gbps"] for mib, s in sizes.items()}
    worst = min(util, key=util.get)
    where = "across two nodes" if pair[0] != pair[1] else "within one node (the cluster has one)"
    s = sizes[worst]
    return (util[worst] >= TARGETS["bw_utilization"], util[worst],
            f"gloo all-reduce busbw {s['busbw_gbps']:.2f} Gb/s vs {s['p2p_bidir_gbps']:.2f} Gb/s point-to-point "
            f"both ways, {where}, worst of {', '.join(f'{m} MiB' for m in sizes)}")


def _train_and_recover(root: str, level: dict[str, Any], min_mfu: float) -> tuple[Check, Check, str]:
    from cs3ray.train.driver import train

    from .recovery import in_thread, joined, kill_and_measure

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
        m = kill_and_measure(lambda: list(seen), level["kill_after"], 300)
    except TimeoutError:
        if "error" in out:
            raise out["error"] from None
        raise
    joined(runner, out, 600, "the validation run")
    before = [e for e in seen if e["event"] == "progress" and e["wall"] < m["killed"]]
    steady = before[1:] or before  # the first window holds start-up
    mfu = statistics.mean(e["mfu"] for e in steady)
    recovery = m["first"]["wall"] - m["killed"]
    return (Check("training_mfu", mfu >= min_mfu, mfu, "of peak", f">= {min_mfu:g} of the measured peak",
                  f"tiny model, 2 workers, {statistics.mean(e['tokens_per_s'] for e in steady):,.0f} tokens/s"),
            Check("recovery", recovery <= TARGETS["recovery_s"], recovery, "s", f"<= {TARGETS['recovery_s']:g} s",
                  f"SIGKILL of a worker at step {m['last_before']}: training again from the step-"
                  f"{next(e['step'] for e in seen if e['event'] == 'restored' and e['wall'] > m['killed'])} snapshot"),
            run_dir)


def _serve(run_dir: str, level: dict[str, Any]) -> tuple[bool, float, str]:
    from cs3ray.serve.deploy import deploy, make_spec, shutdown

    from .serve_load import run_load, workload

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up lines are not the checklist's
    spec = make_spec(run_dir, name="cs3-validate", overrides={"max_batch": 8})
    url = deploy(spec, "127.0.0.1", free_port())
    try:
        r = run_load(url, spec.name, workload(level["requests"], rate=8.0, seed=0, output_tokens=(24, 48)))
    finally:
        shutdown(spec.name)
    if r["errors"]:
        raise RuntimeError(f"{r['errors']} of {r['requests']} requests failed: {r['first_error']}")
    p99 = r["p99_itl_ms"]
    return (p99 <= TARGETS["p99_itl_ms"], p99, f"{r['requests']} streamed requests at 8/s, "
            f"{r['tokens_per_s']:,.0f} tokens/s, p50 {r['p50_itl_ms']:.1f} ms")


def _storage(url: str, mb: int) -> tuple[bool, float, str]:
    folder = open_url(url).child(f".cs3-validate-{os.getpid()}")
    data = os.urandom(mb * MIB)
    try:
        folder.write_bytes(data, "probe.bin")
        del data
        t0 = time.perf_counter()
        got = len(folder.read_bytes("probe.bin"))
        rate = got / MIB / (time.perf_counter() - t0)
    finally:
        folder.rm("probe.bin", missing_ok=True)
        folder.rm(missing_ok=True)
    return rate >= TARGETS["read_mb_per_s"], rate, f"{mb} MiB read back from {url}"


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
        checks.append(_check("collective_busbw", "of link", f">= {TARGETS['bw_utilization']:g} of point-to-point",
                             lambda: _collective([n["NodeID"] for n in nodes], level)))
        log(f"  {checks[-1].name}: {checks[-1].detail}")
        try:
            mfu, recovery, run_dir = _train_and_recover(root, level, min_mfu)
        except Exception as exc:  # noqa: BLE001 - both items fail with the run's error; serving has no checkpoint
            mfu = Check("training_mfu", False, None, "of peak", f">= {min_mfu:g} of the measured peak", _error(exc))
            recovery = Check("recovery", False, None, "s", f"<= {TARGETS['recovery_s']:g} s", _error(exc))
            run_dir = None
        checks += [mfu, recovery]
        log(f"  training: MFU {mfu.figure}, recovery {recovery.figure} s")
        if run_dir:
            checks.append(_check("serve_p99_itl", "ms", f"<= {TARGETS['p99_itl_ms']:g} ms", lambda: _serve(run_dir, level)))
        else:
            checks.append(Check("serve_p99_itl", False, None, "ms", f"<= {TARGETS['p99_itl_ms']:g} ms",
                                "error: no checkpoint to serve (the training run failed)"))
        checks.append(_check("storage_read", "MB/s", f">= {TARGETS['read_mb_per_s']:g} MB/s",
                             lambda: _storage(storage or root, level["read_mb"])))
        checks.append(_check("metrics_endpoint", "nodes", "every node's endpoint parses as Prometheus text",
                             lambda: _metrics(nodes)))
    return {"level": "quick" if quick else "full", "passed": all(c.passed for c in checks),
            "checks": {c.name: asdict(c) for c in checks}}


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: item, PASS/FAIL, figure, target, what was measured."""
    def fig(c: dict) -> str:
        return "-" if c["figure"] is None else f"{c['figure']:,.3g} {c['unit']}"
    return [(name, "PASS" if c["passed"] else "FAIL", fig(c), c["target"], c["detail"]) for name, c in r["checks"].items()]


COLUMNS = ["item", "result", "figure", "target", "measured"]


def markdown(r: dict[str, Any]) -> str:
    """The report `--out FILE` writes: the same table in markdown."""
    lines = [f"# cs3 validate ({r['level']}): {'PASS' if r['passed'] else 'FAIL'}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in rows(r)]
    return "\n".join(lines) + "\n"
