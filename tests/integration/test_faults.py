"""Fault injection: a worker SIGKILLed mid-run is replaced and the run completes (real Ray cluster);
an S3 outage mid-checkpoint is retried (moto server behind the loopback proxy playing dead)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from cs3ray.config import load_config
from cs3ray.train.elastic import global_samples

from conftest import ROOT, RetryClock


def _events(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _train(ray_head, run_dir, steps, *overrides):
    return subprocess.Popen(["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.steps={steps}",
                             "train.log_every=1", "train.eval_every=100", "cluster.max_failures=2", *overrides,
                             "--address", ray_head.address, "--json"],
                            cwd=ROOT, env=ray_head.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(log, step: int) -> int:
    deadline = time.time() + 240
    while time.time() < deadline and not any(e.get("step", 0) >= step and e["event"] == "progress" for e in _events(log)):
        time.sleep(0.2)
    return max(e["step"] for e in _events(log) if e["event"] == "progress")


@pytest.mark.slow
def test_worker_sigkill_mid_run_recovers_from_the_snapshot(ray_head, tmp_path):
    run_dir = tmp_path / "killed"
    proc = _train(ray_head, run_dir, 14, "checkpoint.every=4", "train.batch_size=8")  # half the batch: shorter steps
    log = run_dir / "events.jsonl"
    killed_at = _wait_for_step(log, 6)
    start = [e for e in _events(log) if e["event"] == "start"][-1]
    os.kill(start["pids"][1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 14 and summary["restarts"] == 1 and summary["workers"] == 2
    from cs3ray.train.restarts import DIED

    # A SIGKILL leaves no error to report; the survivor's broken collective is named as its echo.
    assert len(summary["restart_causes"]) == 1 and summary["restart_causes"][0].startswith(DIED)
    restored = [e for e in _events(log) if e["event"] == "restored"]
    assert len(restored) == 1 and 4 <= restored[0]["step"] <= killed_at + 2
    assert (run_dir / "step-00000014" / "manifest.json").exists()


@pytest.mark.slow
def test_replicas_keep_training_through_a_sigkill_and_the_replacement_heals(ray_head, tmp_path):
    run_dir = tmp_path / "replicas"
    proc = _train(ray_head, run_dir, 20, "checkpoint.every=4", "cluster.fault_tolerance=replicas", "cache.trace=true")
    log = run_dir / "events.jsonl"
    _wait_for_step(log, 5)
    victim = next(e for e in _events(log) if e["event"] == "worker" and e["rank"] == 1)
    killed = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["restarts"] == 0 and summary["replaced_workers"] == 1
    events = _events(log)
    after = [e for e in events if e["wall"] > killed]
    healed = [e for e in after if e["event"] == "healed"]
    assert len(healed) == 1 and healed[0]["rank"] == 1
    # The survivor trained alone (no restart, nothing restored) until the replacement healed from it.
    alone = [e for e in after if e["event"] == "progress" and e["workers"] == 1]
    assert alone and alone[0]["step"] <= healed[0]["step"] and not [e for e in events if e["event"] == "restored"]
    assert any(e["event"] == "progress" and e["workers"] == 2 and e["step"] > healed[0]["step"] for e in after)
    steps = [e["step"] for e in events if e["event"] == "progress"]
    assert steps == list(range(1, 21))  # every step once: none lost, none repeated
    # Whoever was training, each snapshot's data position is exactly its step's global batches.
    global_batch = global_samples(load_config(ROOT / "configs/tiny.yaml"))
    snaps = [e for e in events if e["event"] == "checkpoint"]
    assert snaps and all(e["data_samples"] == e["step"] * global_batch for e in snaps)
    assert (run_dir / "step-00000020" / "manifest.json").exists()
    # What the replicas really trained on (their data trace) is the global order's first 20 batches, each once.
    from cs3ray.bench.recovery import data_audit

    cfg = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={run_dir}"])
    assert data_audit(cfg, str(run_dir), 20) == {"samples_repeated": 0, "samples_skipped": 0, "samples_unexpected": 0,
                                                 "samples_trained": 20 * global_batch,
                                                 "samples_expected": 20 * global_batch}


def test_s3_outage_mid_save_and_mid_restore_is_retried_then_a_lasting_one_fails_clearly(s3_server, caplog,
                                                                                         monkeypatch):
    import torch

    from cs3ray.bench.loopback_s3 import LatencyProxy
    from cs3ray.ckpt import CheckpointError, CheckpointManager

    endpoint, options = s3_server
    proxy = LatencyProxy(endpoint, latency_s=0.0)
    # botocore's own retries off, so the outage reaches cs3ray's retry (it would otherwise hide short ones):
    # `total_max_attempts` counts the first request (`max_attempts: 1` left one retry).
    opts = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.url},
            "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    url = f"s3://cs3/outage-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(128, 64) for i in range(12)}}
    try:
        mgr = CheckpointManager(url, opts)
        proxy.outage_from("/chunks/", seconds=1.5)  # from the first chunk upload on
        mgr.save(1, state, {"step": 1}, {"torch": torch.get_rng_state()}, {"config.yaml": "a: 1\n"})
        assert proxy.outage_over()
        retried = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying")]
        assert any("/chunks/" in m for m in retried), retried

        caplog.clear()
        proxy.outage_from("/chunks/", seconds=1.5)  # from the first chunk read on
        fresh = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        step, _, _ = CheckpointManager(url, opts).load(fresh)
        assert proxy.outage_over()
        assert step == 1 and all(torch.equal(fresh["model"][k], v) for k, v in state["model"].items())
        assert any(r.getMessage().startswith("retrying") for r in caplog.records)

        proxy.down = True  # an outage that outlasts the deadline: one clear error, no traceback
        clock = RetryClock(monkeypatch)  # from here on the retries' waits are recorded, not slept
        with pytest.raises(CheckpointError) as info:
            CheckpointManager(url, opts, retry_deadline_s=1.5).load(fresh)
        # The restore gave up after one deadline's worth of backoff, not one per file or location it tried.
        assert sum(clock.waits) == pytest.approx(1.5), clock.waits
        assert "within 1.5s" in str(info.value) and "check that the storage is reachable" in str(info.value)
    finally:
        proxy.down = False
        proxy.stop()


@pytest.mark.slow
def test_a_worker_error_restarts_the_group_and_says_why(ray_head, tmp_path):
    from helpers.transforms import FAIL_AT, FAILED_ONCE

    FAILED_ONCE.unlink(missing_ok=True)
    run_dir = tmp_path / "failing"
    try:
        proc = subprocess.run(["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=8",
                               "train.log_every=1", "train.eval_every=100", "checkpoint.every=2", "cluster.workers=1",
                               "cluster.max_failures=1", "train.batch_size=8", "precision=fp32",
                               "data.transform=tests.helpers.transforms:fail_once", "train.eval_batches=1",
                               # a ~0.1M-parameter model: what is checked is the restart and its cause
                               "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128",
                               "--address", ray_head.address],
                              cwd=ROOT, env=ray_head.env(), capture_output=True, text=True, timeout=400)
    finally:
        FAILED_ONCE.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cause = f"worker 0 failed at step {FAIL_AT - 1}: RuntimeError: injected failure in data.transform at batch {FAIL_AT}"
    # One line on the console, the event in the log, the summary and the report.
    assert f"restart 1: {cause}" in " ".join(proc.stderr.split()), proc.stderr[-3000:]  # as the console wraps it
    restarts = [e for e in _events(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [(e["attempt"], e["cause"]) for e in restarts] == [(1, cause)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restart_causes"] == [cause] and summary["steps"] == 8
    report = subprocess.run(["cs3", "report", str(run_dir), "--out", str(tmp_path / "report")], cwd=ROOT,
                            env=ray_head.env(), capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert cause in (tmp_path / "report" / "report.md").read_text()
