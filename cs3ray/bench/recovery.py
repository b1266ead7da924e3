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

from .ray_train_peer import make_trainer


def _wait_for(events: Callable[[], list[dict]], pred: Callable[[dict], bool], timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((e for e in events() if pred(e)), None)
        if hit:
            return hit
        time.sleep(0.05)
    raise TimeoutError("the benchmark run did not reach the expected state in time")


def _measure(events: Callable[[], list[dict]], kill_after: int, timeout: float) -> dict[str, Any]:
    """Kill worker 1 after step `kill_after`; return kill time, last step before it, and the events."""
    start = _wait_for(events, lambda e: e["event"] == "progress" and e["step"] >= kill_after, timeout)
    del start
    pids = [e for e in events() if e["event"] == "start"][-1]["pids"]
    last_before = max(e["step"] for e in events() if e["event"] == "progress")
    killed = time.time()
    os.kill(pids[1], signal.SIGKILL)
    restart = _wait_for(events, lambda e: e["event"] == "start" and e["wall"] > killed, timeout)
    first = _wait_for(events, lambda e: e["event"] == "progress" and e["wall"] > killed, timeout)
    return {"killed": killed, "last_before": last_before, "restart": restart, "first": first}


def _cs3_run(root: str, steps: int, every: int, batch: int, kill_after: int, timeout: float) -> dict[str, Any]:
    run_dir = os.path.join(root, "cs3")
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={run_dir}", f"train.steps={steps}", f"checkpoint.every={every}", "train.log_every=1",
        "train.eval_every=100000", "train.eval_batches=1", f"train.batch_size={batch}", "cluster.max_failures=2",
        "checkpoint.keep=2"])
    seen: list[dict] = []
    result: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: result.update(summary=train(cfg, on_event=seen.append, quiet=True)),
                              daemon=True)
    runner.start()
    m = _measure(lambda: list(seen), kill_after, timeout)
    runner.join(timeout)
    restored = next(e for e in seen if e["event"] == "restored" and e["wall"] > m["killed"])
    expected = restored["step"] * batch * 2  # global samples consumed by the restored step
    position = int(restored.get("data_samples") or 0)  # where the snapshot says the data order stands
    return {
        "recovery_s": m["first"]["wall"] - m["killed"],
        "full_size_s": m["first"]["wall"] - m["killed"] if m["restart"]["workers"] == 2 else None,
        "steps_lost": m["last_before"] - restored["step"],
        "samples_repeated": max(0, expected - position), "samples_skipped": max(0, position - expected),
        "restored_from": restored.get("restored_from", "storage"),
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
    """Both runs in one embedded cluster; returns the JSON-able result."""
    every = 5
    steps, kill_after, timeout = (30, 12, 300) if quick else (60, 17, 500)
    batch = 8
    with tempfile.TemporaryDirectory(prefix="cs3-bench-recovery-") as root, ray_cluster(None, num_cpus=8, quiet=True):
        log("cs3ray: 2 workers, SIGKILL one mid-run")
        ours = _cs3_run(root, steps, every, batch, kill_after, timeout)
        log(f"  back to training {ours['recovery_s']:.1f}s after the kill (restored from {ours['restored_from']})")
        log("plain Ray Train loop: 2 workers, SIGKILL one mid-run")
        peer = _peer_run(root, steps, every, batch, kill_after, timeout)
        log(f"  back to training {peer['ray_train_recovery_s']:.1f}s after the kill")
    return {**ours, **peer, "interval_steps": every,
            "recovery_ratio": ours["recovery_s"] / peer["ray_train_recovery_s"]}
