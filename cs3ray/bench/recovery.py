"""`cs3 bench recovery`: time from a worker's SIGKILL to training again, cs3ray vs. plain Ray Train.

Every run trains the same model with 2 workers and a snapshot every K steps; one worker
process is killed with SIGKILL once the run is past 2K steps. Measured from the kill, for
each of cs3ray's fault-tolerance modes and for a plain Ray Train loop in the same cluster:
the next completed global step (`recovery_s`), training again at the full worker count
(`full_size_s`), and the steps that had to be redone. The cs3ray runs keep a data trace
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

from .ray_train_peer import make_trainer

FAULT_TOLERANCE = "replicas"  # the mode whose figures are the top-level keys


def wait_for(events: Callable[[], list[dict]], pred: Callable[[dict], bool], timeout: float) -> dict:
    """The first event that satisfies `pred`, polling `events()`; TimeoutError after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((e for e in events() if pred(e)), None)
        if hit:
            return hit
        time.sleep(0.05)
    raise TimeoutError("the benchmark run did not reach the expected state in time")


def kill_and_measure(events: Callable[[], list[dict]], kill_after: int, timeout: float, replicas: bool = False) -> dict[str, Any]:
    """Kill worker 1 after step `kill_after`; return kill time, last step before it, and the events."""
    wait_for(events, lambda e: e["event"] == "progress" and e["step"] >= kill_after, timeout)
    if replicas:  # every replica announces its own process
        pid = [e for e in events() if e["event"] == "worker" and e["rank"] == 1][-1]["pid"]
    else:
        pid = [e for e in events() if e["event"] == "start"][-1]["pids"][1]
    last_before = max(e["step"] for e in events() if e["event"] == "progress")
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    back = "worker" if replicas else "start"  # the replacement process, or the restarted group
    restart = wait_for(events, lambda e: e["event"] == back and e["wall"] > killed, timeout)
    first = wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed, timeout)
    full = wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed and e.get("workers", 2) == 2,
                     timeout)
    return {"killed": killed, "last_before": last_before, "restart": restart, "first": first, "full": full}


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


def _cs3_run(root: str, steps: int, every: int, batch: int, kill_after: int, timeout: float,
             fault_tolerance: str) -> dict[str, Any]:
    run_dir = os.path.join(root, f"cs3-{fault_tolerance}")
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"train.steps={steps}", f"checkpoint.every={every}", "train.log_every=1",
        "train.eval_every=100000", "train.eval_batches=1", f"train.batch_size={batch}", "cluster.max_failures=2",
        "checkpoint.keep=2", f"cluster.fault_tolerance={fault_tolerance}", "cache.trace=true"])
    seen: list[dict] = []
    runner, out = in_thread(lambda: train(cfg, on_event=seen.append, quiet=True))
    replicas = fault_tolerance == "replicas"
    try:
        m = kill_and_measure(lambda: list(seen), kill_after, timeout, replicas)
    except TimeoutError:
        if "error" in out:  # the run failed: that is the error to name
            raise out["error"] from None
        raise
    summary = joined(runner, out, timeout, f"the cs3ray run (fault_tolerance={fault_tolerance})")
    killed = m["killed"]
    if replicas:  # nothing is restored: the survivor goes on from its live state
        resumed_at, source = m["first"]["step"] - 1, "peer"
    else:
        restored = next(e for e in seen if e["event"] == "restored" and e["wall"] > killed)
        resumed_at, source = restored["step"], restored.get("restored_from", "storage")
    return {
        "recovery_s": m["first"]["wall"] - killed,
        "full_size_s": m["full"]["wall"] - killed,
        "steps_lost": max(0, m["last_before"] - resumed_at),
        **data_audit(cfg, run_dir, summary["steps"]),
        "restored_from": source,
        "completed": summary["steps"],
    }


def _peer_run(root: str, steps: int, every: int, batch: int, kill_after: int, timeout: float) -> dict[str, Any]:
    log = os.path.join(root, "peer-events.jsonl")
    open(log, "w").close()

    def events() -> list[dict]:
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]

    trainer = make_trainer(log, os.path.join(root, "peer-storage"), steps, every, batch, 128)
    runner, out = in_thread(trainer.fit)
    try:
        m = kill_and_measure(events, kill_after, timeout)
    except TimeoutError:
        if "error" in out:
            raise out["error"] from None
        raise
    joined(runner, out, timeout, "the plain Ray Train run")
    return {"ray_train_recovery_s": m["first"]["wall"] - m["killed"],
            "ray_train_full_size_s": m["full"]["wall"] - m["killed"],
            "ray_train_steps_lost": m["last_before"] - m["restart"]["step"]}


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The three runs in one embedded cluster; returns the JSON-able result.

    Top-level keys are those of the mode named in `fault_tolerance` (cs3ray's best, replicas);
    `modes` holds both, each with its times as ratios of plain Ray Train's.
    """
    every = 5
    steps, kill_after, timeout = (30, 12, 300) if quick else (60, 17, 500)
    batch = 8
    modes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cs3-bench-recovery-") as root, ray_cluster(None, num_cpus=8, quiet=True, use_recorded=False):
        for mode in ("restart", "replicas"):
            log(f"cs3ray, cluster.fault_tolerance={mode}: 2 workers, SIGKILL one mid-run")
            modes[mode] = _cs3_run(root, steps, every, batch, kill_after, timeout, mode)
            m = modes[mode]
            log(f"  training again {m['recovery_s']:.1f}s after the kill, at full size after {m['full_size_s']:.1f}s "
                f"(state from {m['restored_from']}); samples repeated {m['samples_repeated']}, "
                f"skipped {m['samples_skipped']}")
        log("plain Ray Train loop: 2 workers, SIGKILL one mid-run")
        peer = _peer_run(root, steps, every, batch, kill_after, timeout)
        log(f"  back to training {peer['ray_train_recovery_s']:.1f}s after the kill, at full size after "
            f"{peer['ray_train_full_size_s']:.1f}s")
    for m in modes.values():
        m["recovery_ratio"] = m["recovery_s"] / peer["ray_train_recovery_s"]
        m["full_size_ratio"] = m["full_size_s"] / peer["ray_train_full_size_s"]
    best = modes[FAULT_TOLERANCE]
    return {**best, **peer, "interval_steps": every, "fault_tolerance": FAULT_TOLERANCE, "modes": modes}


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: each cs3ray mode next to plain Ray Train, times and what the data trace shows."""
    out = [(mode, f"{m['recovery_s']:.1f} ({m['recovery_ratio']:.2f}x)", f"{m['full_size_s']:.1f} "
            f"({m['full_size_ratio']:.2f}x)", m["steps_lost"], m["samples_repeated"], m["samples_skipped"],
            m["restored_from"]) for mode, m in r["modes"].items()]
    out.append(("Ray Train", f"{r['ray_train_recovery_s']:.1f}", f"{r['ray_train_full_size_s']:.1f}",
                r["ray_train_steps_lost"], "-", "-", "storage"))
    return out


# Seconds from the kill to the next completed step and to training at full size (in brackets:
# as a ratio of plain Ray Train's); steps redone; samples repeated and skipped per the data trace.
COLUMNS = ["run", "next step", "full size", "lost", "repeated", "skipped", "from"]
