"""Fault injection on a real Ray cluster: a worker SIGKILLed mid-run is replaced and the run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import ROOT


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_worker_sigkill_mid_run_recovers_from_the_snapshot(ray_head, tmp_path):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=40",
                             "checkpoint.every=10", "train.log_every=2", "train.eval_every=100",
                             "cluster.max_failures=2", "--address", ray_head.address, "--json"],
                            cwd=ROOT, env=ray_head.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = run_dir / "events.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not any(e.get("step", 0) >= 14 and e["event"] == "progress" for e in _events(log)):
        time.sleep(0.5)
    start = [e for e in _events(log) if e["event"] == "start"][-1]
    killed_at = max(e["step"] for e in _events(log) if e["event"] == "progress")
    os.kill(start["pids"][1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 40 and summary["restarts"] == 1 and summary["workers"] == 2
    restored = [e for e in _events(log) if e["event"] == "restored"]
    assert len(restored) == 1 and 10 <= restored[0]["step"] <= killed_at + 2
    assert (run_dir / "step-00000040" / "manifest.json").exists()
