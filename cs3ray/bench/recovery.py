"""`cs3 bench recovery`: time from a worker's SIGKILL to training again, cs3ray vs. plain Ray Train.

Both runs train the same model with 2 workers and a snapshot every K steps; one worker
process is killed with SIGKILL once the run is past 2K steps. Measured from the kill: the
next completed global step (`recovery_s`), training again at the full worker count
(`full_size_s`), and the steps that had to be redone. For cs3ray the restored snapshot's
data position is checked against its step: the exact global order means no sample is
repeated or skipped relative to the snapshot.
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
from cs3ray.ops.cluster import ray_cluster
from cs3ray.train.driver import train
from cs3ray.train.elastic import global_samples

from .ray_train_peer import make_trainer


def _wait_for(events: Callable[[], list[dict]], pred: Callable[[dict], bool], timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((e for e in events() if pred(e)), None)
        if hit:
            return hit
        time.sleep(0.05)
    raise TimeoutError("the benchmark run did not reach the expected state in time")


def _measure(events: Callable[[], list[dict]], kill_after: int, timeout: float, replicas: bool = False) -> dict[str, Any]:
    """Kill worker 1 after step `kill_after`; return kill time, last step before it, and the events."""
    _wait_for(events, lambda e: e["event"] == "progress" and e["step"] >= kill_after, timeout)
    if replicas:  # every replica announces its own process
        pid = [e for e in events() if e["event"] == "worker" and e["rank"] == 1][-1]["pid"]
    else:
        pid = [e for e in events() if e["event"] == "start"][-1]["pids"][1]
    last_before = max(e["step"] for e in events() if e["event"] == "progress")
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    back = "worker" if replicas else "start"  # the replacement process, or the restarted group
    restart = _wait_for(events, lambda e: e["event"] == back and e["wall"] > killed, timeout)
    first = _wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed, timeout)
    full = _wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed and e.get("workers", 2) == 2,
                     timeout)
    return {"killed": killed, "last_before": last_before, "restart": restart, "first": first, "full": full}


def _cs3_run(root: str, steps: int, every: int, batch: int, kill_after: int, timeout: float,
             fault_tolerance: str) -> dict[str, Any]:
    run_dir = os.path.join(root, f"cs3-{fault_tolerance}")
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"train.steps={steps}", f"checkpoint.every={every}", "train.log_every=1",
        "train.eval_every=100000", "train.eval_batches=1", f"train.batch_size={batch}", "cluster.max_failures=2",
        "checkpoint.keep=2", f"cluster.fault_tolerance={fault_tolerance}"])
    seen: list[dict] = []
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(summary=train(cfg, on_event=seen.append, quiet=True)),
                              daemon=True)
    runner.start()
    replicas = fault_tolerance == "replicas"
    m = _measure(lambda: list(seen), kill_after, timeout, replicas)
    runner.join(timeout)
    killed, per_step = m["killed"], global_samples(cfg)
    if replicas:
        # Nothing is restored: the survivor goes on from its live state. Its first snapshot after
        # the kill says where the data order stands; it must be exactly that step's offset.
        resumed_at = m["first"]["step"] - 1
        snap = next(e for e in seen if e["event"] == "checkpoint" and e["wall"] > killed)
        snap_step, position, source = snap["step"], int(snap.get("data_samples") or 0), "peer"
    else:
        restored = next(e for e in seen if e["event"] == "restored" and e["wall"] > killed)
        resumed_at = snap_step = restored["step"]
        position, source = int(restored.get("data_samples") or 0), restored.get("restored_from", "storage")
    expected = snap_step * per_step
    return {
        "recovery_s": m["first"]["wall"] - killed,
        "full_size_s": m["full"]["wall"] - killed,
        "steps_lost": max(0, m["last_before"] - resumed_at),
        "samples_repeated": max(0, expected - position), "samples_skipped": max(0, position - expected),
        "restored_from": source,
        "completed": result.get("summary", {}).get("steps"),
    }


def _peer_run(root: str, steps: int, every: int, batch: int, kill_after: int, timeout: float) -> dict[str, Any]:
    log = os.path.join(root, "peer-events.jsonl")
    open(log, "w").close()

    def events() -> list[dict]:
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]

    trainer = make_trainer(log, os.path.join(root, "peer-storage"), steps, every, batch, 128)
    runner = threading.Thread(target=trainer.fit, daemon=True)
    runner.start()
    m = _measure(events, kill_after, timeout)
    runner.join(timeout)
    return {"ray_train_recovery_s": m["first"]["wall"] - m["killed"],
            "ray_train_steps_lost": m["last_before"] - m["restart"]["step"]}


def run(quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The three runs in one embedded cluster; returns the JSON-able result.

    Top-level keys are cs3ray's best mode (fault-tolerant replicas); `modes` holds both.
    """
    every = 5
    steps, kill_after, timeout = (30, 12, 300) if quick else (60, 17, 500)
    batch = 8
    modes: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cs3-bench-recovery-") as root, ray_cluster(None, num_cpus=8, quiet=True):
        for mode in ("restart", "replicas"):
            log(f"cs3ray, cluster.fault_tolerance={mode}: 2 workers, SIGKILL one mid-run")
            modes[mode] = _cs3_run(root, steps, every, batch, kill_after, timeout, mode)
            log(f"  training again {modes[mode]['recovery_s']:.1f}s after the kill, at full size after "
                f"{modes[mode]['full_size_s']:.1f}s (state from {modes[mode]['restored_from']})")
        log("plain Ray Train loop: 2 workers, SIGKILL one mid-run")
        peer = _peer_run(root, steps, every, batch, kill_after, timeout)
        log(f"  back to training {peer['ray_train_recovery_s']:.1f}s after the kill")
    best = modes["replicas"]
    return {**best, **peer, "interval_steps": every, "fault_tolerance": "replicas", "modes": modes,
            "recovery_ratio": best["recovery_s"] / peer["ray_train_recovery_s"]}
