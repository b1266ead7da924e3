"""`cs3 bench recovery`: time from a worker's SIGKILL to training again, cs3ray vs. plain Ray Train.

Every run trains the same model with 2 workers and a snapshot every K steps; one worker
process is killed with SIGKILL once the run is past 2K steps, and again (a round per kill) each
time training is back at full size, at the same place within the snapshot interval. Measured
from each kill, for each of cs3ray's fault-tolerance modes and for a plain Ray Train loop in the
same cluster: the next completed global step (`recovery_s`), training again at the full worker
count (`full_size_s`), and the steps that had to be redone. The cs3ray runs keep a data trace
(`cache.trace`: the sample ids each rank trained on, per completed step); after the run it is
compared with the exact global order, so `samples_repeated` and `samples_skipped` count what
the workers really trained on, whatever the restored data position claimed.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from typing import Any, Callable

from cs3ray.config import load_config
from cs3ray.data.shards import read_manifest
from cs3ray.data.stream import GlobalOrder
from cs3ray.data.trace import audit, read_trace
from cs3ray.ops.cluster import ray_cluster
from cs3ray.storage import open_url
from cs3ray.train.driver import prepare_data, train
from cs3ray.train.elastic import global_samples

from .ray_train_peer import last_step, make_trainer
from .stats import METHOD as STATS_METHOD
from .stats import judge, shown, summarize

FAULT_TOLERANCE = "replicas"  # the mode whose figures are the top-level keys
ROUNDS = 3  # kills per run by default
STOP_MARGIN_STEPS = 10  # the peer's last step, past the newest seen: both its ranks read the stop file before it
TARGETS = {"recovery_ratio": {"at_most": 0.5}}


def wait_for(events: Callable[[], list[dict]], pred: Callable[[dict], bool], timeout: float) -> dict:
    """The first event that satisfies `pred`, polling `events()`; TimeoutError after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((e for e in events() if pred(e)), None)
        if hit:
            return hit
        time.sleep(0.05)
    raise TimeoutError("the benchmark run did not reach the expected state in time")


def kill_once(events: Callable[[], list[dict]], kill_after: int, timeout: float, replicas: bool = False) -> dict[str, Any]:
    """SIGKILL worker 1 after step `kill_after`; the kill's time, steps completed before it and what followed."""
    wait_for(events, lambda e: e["event"] == "progress" and e["step"] >= kill_after, timeout)
    if replicas:  # every replica announces its own process
        pid = [e for e in events() if e["event"] == "worker" and e["rank"] == 1][-1]["pid"]
    else:
        pid = [e for e in events() if e["event"] == "start"][-1]["pids"][1]
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    back = "worker" if replicas else "start"  # the replacement process, or the restarted group
    restart = wait_for(events, lambda e: e["event"] == back and e["wall"] > killed, timeout)
    first = wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed, timeout)
    full = wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed and e.get("workers", 2) == 2,
                    timeout)
    # Events reach the driver in batches: what was completed before the kill is known by the workers'
    # clocks once training goes on, not by what the driver had seen when it killed.
    last_before = max(e["step"] for e in events() if e["event"] == "progress" and e["wall"] < killed)
    return {"killed": killed, "last_before": last_before, "restart": restart, "first": first, "full": full}


def kill_rounds(events: Callable[[], list[dict]], first_kill: int, every: int, rounds: int, timeout: float,
                replicas: bool = False) -> list[dict[str, Any]]:
    """`kill_once`, `rounds` times: the first after step `first_kill`, each later one at the same place
    within the snapshot interval (`first_kill` mod `every`) once training is back at full size and a
    snapshot has been taken since, so every round restores from the same distance."""
    out: list[dict[str, Any]] = []
    kill_after = first_kill
    for _ in range(rounds):
        out.append(kill_once(events, kill_after, timeout, replicas))
        kill_after = next_kill(out[-1]["full"]["step"], first_kill, every)
    return out


def next_kill(full_step: int, first_kill: int, every: int) -> int:
    """The step after which to kill next: at least a snapshot interval past `full_step` (training back at
    full size), at the first kill's place within the interval."""
    step = full_step + every
    return step + (first_kill - step) % every


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `fn` in a daemon thread; the dict gets its "result" or its "error"."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread (joined)
            out["error"] = exc
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict[str, Any], timeout: float, what: str) -> Any:
    """The result of an `in_thread` function once it ends (its error re-raised here); TimeoutError if it does not."""
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
    if "error" in out:
        raise out["error"]
    return out["result"]


def data_audit(cfg, run_dir: str, steps: int) -> dict[str, int]:
    """The run's data trace against the first `steps` global batches of the exact order."""
    shards, _ = prepare_data(cfg)  # the shard set the run trained on (cached)
    order = GlobalOrder(read_manifest(shards)["splits"]["train"], cfg.train.seed, cfg.cache.shuffle_window)
    a = audit(read_trace(open_url(run_dir).child("data-trace")), order.ids(0, steps * global_samples(cfg)))
    return {"samples_repeated": a.repeated, "samples_skipped": a.skipped, "samples_unexpected": a.unexpected,
            "samples_trained": a.trained, "samples_expected": a.expected}


def _stopped_when_done(kills: Callable[[], list[dict[str, Any]]], stop: Callable[[], None]) -> list[dict[str, Any]]:
    """Run `kills`, then ask the run to stop (also when a kill round failed, so the run ends)."""
    try:
        return kills()
    finally:
        stop()


def _cs3_run(root: str, plan: dict[str, Any], fault_tolerance: str) -> dict[str, Any]:
    run_dir = os.path.join(root, f"cs3-{fault_tolerance}")
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"train.steps={plan['steps']}", f"checkpoint.every={plan['every']}", "train.log_every=1",
        "train.eval_every=100000", "train.eval_batches=1", f"train.batch_size={plan['batch']}",
        f"cluster.max_failures={plan['rounds'] + 1}", "checkpoint.keep=2", f"cluster.fault_tolerance={fault_tolerance}",
        "cache.trace=true"])
    seen: list[dict] = []
    stop = threading.Event()
    runner, out = in_thread(lambda: train(cfg, on_event=seen.append, quiet=True, stop=stop))
    replicas = fault_tolerance == "replicas"
    try:
        kills = _stopped_when_done(lambda: kill_rounds(lambda: list(seen), plan["first_kill"], plan["every"],
                                                       plan["rounds"], plan["timeout"], replicas), stop.set)
    except TimeoutError:
        if "error" in out:  # the run failed: that is the error to name
            raise out["error"] from None
        raise
    summary = joined(runner, out, plan["timeout"], f"the cs3ray run (fault_tolerance={fault_tolerance})")
    lost, sources = [], set()
    for m in kills:
        if replicas:  # nothing is restored: the survivor goes on from its live state
            resumed_at, source = m["first"]["step"] - 1, "peer"
        else:
            restored = next(e for e in seen if e["event"] == "restored" and e["wall"] > m["killed"])
            resumed_at, source = restored["step"], restored.get("restored_from", "storage")
        lost.append(max(0, m["last_before"] - resumed_at))
        sources.add(source)
    trace = data_audit(cfg, run_dir, summary["steps"])
    # A restart redoes the steps after its snapshot: their samples are trained again, and the data
    # position is exact when that is all the trace repeats.
    redone = sum(lost) * global_samples(cfg)
    return {
        "recovery_s_rounds": [m["first"]["wall"] - m["killed"] for m in kills],
        "full_size_s_rounds": [m["full"]["wall"] - m["killed"] for m in kills],
        "steps_lost_rounds": lost,
        "steps_lost": sum(lost),
        **trace,
        "samples_redone": redone,
        "data_exact": trace["samples_skipped"] == 0 and trace["samples_unexpected"] == 0
        and trace["samples_repeated"] == redone,
        "restored_from": "/".join(sorted(sources)),
        "completed": summary["steps"],
    }


def _peer_run(root: str, plan: dict[str, Any]) -> dict[str, Any]:
    log = os.path.join(root, "peer-events.jsonl")
    open(log, "w").close()

    def events() -> list[dict]:
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def stop() -> None:  # the last step the workers train: a few past the newest one seen
        steps = [e["step"] for e in events() if e["event"] == "progress"]
        last_step(stop_file, max(steps, default=0) + STOP_MARGIN_STEPS)

    stop_file = os.path.join(root, "peer-stop")
    trainer = make_trainer(log, os.path.join(root, "peer-storage"), plan["steps"], plan["every"], plan["batch"], 128,
                           max_failures=plan["rounds"] + 1, stop_file=stop_file)
    runner, out = in_thread(trainer.fit)
    try:
        kills = _stopped_when_done(lambda: kill_rounds(events, plan["first_kill"], plan["every"], plan["rounds"],
                                                       plan["timeout"]), stop)
    except TimeoutError:
        if "error" in out:
            raise out["error"] from None
        raise
    joined(runner, out, plan["timeout"], "the plain Ray Train run")
    return {"recovery_s_rounds": [m["first"]["wall"] - m["killed"] for m in kills],
            "full_size_s_rounds": [m["full"]["wall"] - m["killed"] for m in kills],
            "steps_lost_rounds": [m["last_before"] - m["restart"]["step"] for m in kills]}


def plan(quick: bool) -> dict[str, Any]:
    """Steps, snapshot interval and kill rounds of a run. Runs stop once their last round is over;
    `steps` only bounds a run whose kills never come."""
    return {"every": 5, "batch": 8, "steps": 400, "first_kill": 12 if quick else 17, "rounds": 2 if quick else ROUNDS,
            "timeout": 300 if quick else 500}


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The three runs in one embedded cluster, each with `rounds` kills; returns the JSON-able result.

    Round i of each cs3ray mode is paired with round i of plain Ray Train (the same kill, counted
    from the start of the run) for the ratios. Top-level keys are those of the mode named in
    `fault_tolerance` (cs3ray's best, replicas); `modes` holds both.
    """
    p = plan(quick)
    modes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cs3-bench-recovery-") as root, ray_cluster(None, num_cpus=8, quiet=True, use_recorded=False):
        for mode in ("restart", "replicas"):
            log(f"cs3ray, cluster.fault_tolerance={mode}: 2 workers, SIGKILL one {p['rounds']} times")
            modes[mode] = _cs3_run(root, p, mode)
            m = modes[mode]
            log(f"  training again {_seconds(m['recovery_s_rounds'])} s after each kill, at full size after "
                f"{_seconds(m['full_size_s_rounds'])} s (state from {m['restored_from']}); steps redone "
                f"{m['steps_lost_rounds']}; samples repeated {m['samples_repeated']}, skipped {m['samples_skipped']}")
        log(f"plain Ray Train loop: 2 workers, SIGKILL one {p['rounds']} times")
        peer = _peer_run(root, p)
        log(f"  training again {_seconds(peer['recovery_s_rounds'])} s after each kill, at full size after "
            f"{_seconds(peer['full_size_s_rounds'])} s")
    for m in modes.values():
        m.update(summarize("recovery_s", m.pop("recovery_s_rounds"), difference=True))
        m.update(summarize("full_size_s", m.pop("full_size_s_rounds"), difference=True))
        m.update(summarize("recovery_ratio", [a / b for a, b in zip(m["recovery_s_rounds"], peer["recovery_s_rounds"], strict=True)]))
        m.update(summarize("full_size_ratio",
                           [a / b for a, b in zip(m["full_size_s_rounds"], peer["full_size_s_rounds"], strict=True)]))
        m["verdicts"] = judge(m, TARGETS)
    ray_train = {f"ray_train_{k}": v for k, v in {
        **summarize("recovery_s", peer["recovery_s_rounds"], difference=True),
        **summarize("full_size_s", peer["full_size_s_rounds"], difference=True),
        "steps_lost_rounds": peer["steps_lost_rounds"], "steps_lost": sum(peer["steps_lost_rounds"])}.items()}
    best = modes[FAULT_TOLERANCE]
    return {**best, **ray_train, "interval_steps": p["every"], "rounds": p["rounds"], "fault_tolerance": FAULT_TOLERANCE,
            "modes": modes, "targets": TARGETS, "verdicts": best["verdicts"],
            "method": f"{p['rounds']} kills per run, round i of each mode paired with round i of Ray Train; "
                      f"{STATS_METHOD}"}


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: each cs3ray mode next to plain Ray Train, times and what the data trace shows."""
    out = [(mode, f"{m['recovery_s']:.1f} ({shown(m, 'recovery_ratio')})",
            f"{m['full_size_s']:.1f} ({shown(m, 'full_size_ratio')})", m["steps_lost"], m["samples_repeated"],
            m["samples_skipped"], "yes" if m["data_exact"] else "NO", m["restored_from"])
           for mode, m in r["modes"].items()]
    out.append(("Ray Train", f"{r['ray_train_recovery_s']:.1f}", f"{r['ray_train_full_size_s']:.1f}",
                r["ray_train_steps_lost"], "-", "-", "-", "storage"))
    return out


# Median seconds from a kill to the next completed step and to training at full size (in brackets:
# the median ratio to plain Ray Train's with its interval); steps redone over all kills; samples
# repeated and skipped per the data trace, and whether that is exactly the redone steps' samples.
COLUMNS = ["run", "next step", "full size", "lost", "repeated", "skipped", "exact", "from"]
