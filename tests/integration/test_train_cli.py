"""`cs3 train` end to end on the session's real Ray head: train, checkpoint, generate, Ctrl-C then resume."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from cs3ray_cli.main import app

from conftest import ROOT, TRAINED_STEPS, run_cs3

# A ~0.1M-parameter model and short evaluations where what is checked is the run's flow, not what it learns.
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.eval_batches=2",
         "precision=fp32"]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_train_learns_checkpoints_and_summarises(trained_run):
    run_dir, summary = trained_run
    assert summary["steps"] == TRAINED_STEPS and summary["workers"] == 2 and summary["precision"] == "fp32"
    assert summary["final_val_loss"] < 0.75 * summary["initial_val_loss"]
    assert summary["tokens_per_s"] > 0
    assert 0 < summary["mfu"] <= 1  # against a peak every worker measured at the same moment
    assert summary["checkpoint"].endswith(f"step-{TRAINED_STEPS:08d}")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == TRAINED_STEPS
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-00000005", f"step-{TRAINED_STEPS:08d}"]
    assert (run_dir / "config.yaml").exists()
    events = _events(run_dir)
    assert {"start", "progress", "eval", "checkpoint", "end"} <= {e["event"] for e in events}
    # Each rank's scheduling priority is on record (Ray starts workers at nice 15; see README).
    assert len(next(e for e in events if e["event"] == "start")["nice"]) == 2
    # Every step's seconds, for benches that find the steady state from them.
    step_s = next(e for e in events if e["event"] == "end")["step_s"]
    assert len(step_s) == TRAINED_STEPS and all(t > 0 for t in step_s)


def test_generate_prints_text(trained_run):
    run_dir, _ = trained_run
    proc = run_cs3(["generate", str(run_dir), "--prompt", "def ", "--max-tokens", "40", "--seed", "0"], check=True)
    assert proc.stdout.startswith("def ") and len(proc.stdout.strip()) > 10


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_short_run_trains_in_each_half_precision(short_run, precision):
    run_dir, summary = short_run(precision)
    assert summary["precision"] == precision and summary["steps"] == 4
    progress = [e for e in _events(run_dir) if e["event"] == "progress"]
    assert [e["step"] for e in progress] == [1, 2, 3, 4]
    assert all(math.isfinite(e["loss"]) for e in progress) and math.isfinite(summary["final_val_loss"])
    assert progress[-1]["loss"] < progress[0]["loss"]
    scales = {e["loss_scale"] for e in progress}
    if precision == "fp16":
        assert min(scales) >= 2.0 ** 10, scales  # the loss scaler is on (and rarely backs off)
    else:
        assert scales == {1.0}  # bf16 needs no loss scaling


@pytest.mark.slow
def test_a_fp16_run_generates_and_exports_in_bf16(short_run, tmp_path):
    run_dir, _ = short_run("fp16")
    gen = run_cs3(["generate", str(run_dir), "--dtype", "bf16", "--prompt", "def ", "--max-tokens", "8",
                   "--seed", "0"], check=True)
    assert gen.stdout.startswith("def ")
    out = tmp_path / "model.safetensors"
    exported = run_cs3(["ckpt", "export", str(run_dir), "--dtype", "bf16", "--out", str(out), "--json"], check=True)
    assert json.loads(exported.stdout.strip().splitlines()[-1])["dtype"] == "bfloat16"
    # The file loads with safetensors alone, in a process that never imports cs3ray.
    code = ("import sys; from safetensors.torch import load_file; t = load_file(sys.argv[1]); "
            "print(','.join(sorted({str(v.dtype) for v in t.values()})), len(t), 'cs3ray' in sys.modules)")
    check = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120)
    assert check.returncode == 0, check.stderr
    tensors = 2 + 2 * 9 + 1  # embedding and tied output, 9 in each of 2 blocks, final norm
    assert check.stdout.split() == ["torch.bfloat16", str(tensors), "False"]


def test_reusing_a_run_name_needs_resume_or_overwrite(trained_run, ray_head):
    run_dir, _ = trained_run
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", "--address", ray_head.address],
                   env=ray_head.env())
    assert proc.returncode == 2
    assert "--resume" in proc.stderr and "--overwrite" in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_cluster_is_one_line_and_leaves_no_run(tmp_path):
    result = run_cs3(["train", "configs/tiny.yaml", f"run.dir={tmp_path / 'r'}", "--address", "127.0.0.1:1"],
                     timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot reach the Ray cluster at '127.0.0.1:1'" in result.stderr and "Traceback" not in result.stderr
    # Nothing was written, so the same command works once the cluster is up.
    assert not (tmp_path / "r" / "config.yaml").exists()


@pytest.mark.slow
def test_sigint_leaves_a_checkpoint_that_resume_continues(ray_head, tmp_path):
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=2000",
                             "train.batch_size=8", "train.log_every=1", "checkpoint.every=1000", *SMALL, "--address",
                             ray_head.address],
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
    # In this process: `cs3 generate` as a subprocess is test_generate_prints_text's.
    gen = CliRunner().invoke(app, ["generate", str(run_dir), "--max-tokens", "8"])
    assert gen.exit_code == 0, gen.output
    initial = next(e for e in _events(run_dir) if e["event"] == "eval")["val_loss"]

    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.steps={stopped_at + 3}",
                    "train.batch_size=8", "train.log_every=1", "train.eval_every=1000", *SMALL, "--resume", "--address",
                    ray_head.address,
                    "--json"], env=ray_head.env(), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == stopped_at + 3
    assert summary["initial_val_loss"] == initial  # carried by the checkpoint
    log = _events(run_dir)
    restored = [e for e in log if e["event"] == "restored"]
    assert len(restored) == 1 and restored[0]["step"] == stopped_at
    progress = [e["step"] for e in log if e["event"] == "progress" and e["time"] > restored[0]["time"]]
    assert progress == [stopped_at + 1, stopped_at + 2, stopped_at + 3]  # it goes on from the right step


@pytest.mark.slow
def test_ray_job_submit_runs_the_job_entrypoint(ray_head, tmp_path):
    run_dir = tmp_path / "job"
    env = ray_head.env()
    env["RAY_ADDRESS"] = ray_head.dashboard_url
    proc = subprocess.run(
        ["ray", "job", "submit", "--working-dir", ".", "--runtime-env-json",
         json.dumps({"excludes": ["runs/", ".cs3/", ".git/", "*.egg-info/"]}), "--",
         "python", "jobs/train.py", "configs/tiny.yaml", f"run.dir={run_dir}", "train.steps=4", "train.batch_size=8",
         "train.eval_every=4", "train.log_every=2", "cluster.workers=1", *SMALL],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert '"summary"' in proc.stdout
    assert (run_dir / "step-00000004" / "manifest.json").exists()
