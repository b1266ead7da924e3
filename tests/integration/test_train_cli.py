"""`cs3 train` end to end on the session's real Ray head: train, checkpoint, generate, Ctrl-C then resume."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from conftest import ROOT, run_cs3

STEPS = 40
# Half of tiny.yaml's batch: shorter steps, and the model still learns plenty in 40 of them.
FAST = ["train.eval_every=20", "train.log_every=5", "checkpoint.every=20", "train.warmup_steps=5",
        "train.batch_size=8"]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(ray_head, tmp_path_factory):
    """One tiny run with 2 workers, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.steps={STEPS}", *FAST,
                    "--address", ray_head.address, "--json"], env=ray_head.env(), check=True)
    return run_dir, json.loads(proc.stdout.strip().splitlines()[-1])


def test_train_learns_checkpoints_and_summarises(trained):
    run_dir, summary = trained
    assert summary["steps"] == STEPS and summary["workers"] == 2
    assert summary["final_val_loss"] < 0.75 * summary["initial_val_loss"]
    assert summary["tokens_per_s"] > 0
    assert 0 < summary["mfu"] <= 1  # against a peak every worker measured at the same moment
    assert summary["checkpoint"].endswith(f"step-{STEPS:08d}")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000020", f"step-{STEPS:08d}"]
    assert (run_dir / "config.yaml").exists()
    events = _events(run_dir)
    assert {"start", "progress", "eval", "checkpoint", "end"} <= {e["event"] for e in events}
    # Each rank's scheduling priority is on record (Ray starts workers at nice 15; see README).
    assert len(next(e for e in events if e["event"] == "start")["nice"]) == 2


def test_generate_prints_text(trained):
    run_dir, _ = trained
    proc = run_cs3(["generate", str(run_dir), "--prompt", "def ", "--max-tokens", "40", "--seed", "0"], check=True)
    assert proc.stdout.startswith("def ") and len(proc.stdout.strip()) > 10


def test_reusing_a_run_name_needs_resume_or_overwrite(trained, ray_head):
    run_dir, _ = trained
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", "--address", ray_head.address],
                   env=ray_head.env())
    assert proc.returncode == 2
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr


def test_sigint_leaves_a_checkpoint_that_resume_continues(ray_head, tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=2000",
                             "train.batch_size=8", "train.log_every=1", "checkpoint.every=1000", "--address", ray_head.address],
                            cwd=ROOT, env=ray_head.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = run_dir / "events.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (events.exists() and '"progress"' in events.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "stopped early" in out
    steps = sorted(run_dir.glob("step-*"))
    assert len(steps) == 1 and (steps[0] / "manifest.json").exists()
    stopped_at = int(steps[0].name.removeprefix("step-"))
    gen = run_cs3(["generate", str(run_dir), "--max-tokens", "8"], check=True)
    assert gen.returncode == 0
    initial = next(e for e in _events(run_dir) if e["event"] == "eval")["val_loss"]

    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.steps={stopped_at + 3}",
                    "train.batch_size=8", "train.log_every=1", "train.eval_every=1000", "--resume", "--address", ray_head.address,
                    "--json"], env=ray_head.env(), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == stopped_at + 3
    assert summary["initial_val_loss"] == initial  # carried by the checkpoint
    log = _events(run_dir)
    restored = [e for e in log if e["event"] == "restored"]
    assert len(restored) == 1 and restored[0]["step"] == stopped_at
    progress = [e["step"] for e in log if e["event"] == "progress" and e["time"] > restored[0]["time"]]
    assert progress == [stopped_at + 1, stopped_at + 2, stopped_at + 3]  # it goes on from the right step


def test_ray_job_submit_runs_the_job_entrypoint(ray_head, tmp_path):
    run_dir = tmp_path / "job"
    env = ray_head.env()
    env["RAY_ADDRESS"] = ray_head.dashboard_url
    proc = subprocess.run(
        ["ray", "job", "submit", "--working-dir", ".", "--runtime-env-json",
         json.dumps({"excludes": ["runs/", ".cs3/", ".git/", "*.egg-info/"]}), "--",
         "python", "jobs/train.py", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=10", "train.batch_size=8",
         "train.eval_every=10", "train.log_every=5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '"summary"' in proc.stdout
    assert (run_dir / "step-00000010" / "manifest.json").exists()
