"""`cs3 jobs logs -f` and `cs3 submit` follow a job through a dropped connection (every TCP connection to the
dashboard cut and refused for a few seconds mid-run, as a restarted dashboard or a proxy's timeout does),
print each line once, read like `cs3 train`, and exit with the job's result; `--name` refuses a second job
for a run that is already training."""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

from conftest import ROOT, run_cs3
from helpers.tcp_proxy import TcpProxy

STEPS = 40
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", f"train.steps={STEPS}", "train.warmup_steps=0", f"train.eval_every={STEPS}",
         "train.log_every=1", "train.eval_batches=1", f"checkpoint.every={STEPS}", "cluster.workers=1",
         "data.max_bytes=200000", "precision=fp32"]


def _env(ray_head) -> dict[str, str]:
    return {k: v for k, v in ray_head.env().items() if k != "RAY_ADDRESS"}


def test_a_dropped_log_stream_is_resumed_without_repeating_a_line(ray_head, tmp_path):
    env = _env(ray_head)
    name = f"follow-{uuid.uuid4().hex[:6]}"
    submitted = run_cs3(["submit", "configs/tiny.yaml", *SMALL, f"run.dir={tmp_path / 'runs'}", "--name", name,
                         "--no-wait", "--address", ray_head.dashboard_url], env=env, cwd=ROOT, check=True)
    job_id = submitted.stdout.strip().splitlines()[-1]
    # The same run again while it trains: an error, not a second job.
    again = run_cs3(["submit", "configs/tiny.yaml", *SMALL, f"run.dir={tmp_path / 'runs'}", "--name", name,
                     "--no-wait", "--address", ray_head.dashboard_url], env=env, cwd=ROOT)
    lines = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and len(lines) == 1 and f"already being trained by job {job_id}" in lines[0], \
        again.stderr[-2000:]

    port = int(ray_head.dashboard_url.rsplit(":", 1)[1])
    proxy = TcpProxy(("127.0.0.1", port))
    proc = subprocess.Popen(["cs3", "jobs", "logs", job_id, "-f", "--address", proxy.url], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("step ") for line in out) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(line.startswith("step ") for line in out), "no step line before the deadline"
        proxy.cut(3.0)  # mid-run: every connection closed, new ones refused for 3 s
        proc.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.close()
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    assert "dropped" in err and "reconnected" in err and f"job {job_id} succeeded" in err
    steps = [line for line in out if line.startswith("step ") and ": loss " in line]
    # Every step window once, in order, rendered as `cs3 train` would (no JSON event lines).
    assert [int(line.split(":")[0].split()[1]) for line in steps] == list(range(1, STEPS + 1)), out
    assert not [line for line in out if line.startswith("{")]
    assert any(line.startswith(f"run {name}: {STEPS} steps") for line in out)
    # --raw gives the job's own JSON lines.
    raw = run_cs3(["jobs", "logs", job_id, "--raw", "--address", ray_head.dashboard_url], env=env, check=True)
    assert '"event": "progress"' in raw.stdout


def test_following_a_failed_job_exits_1(ray_head):
    env = _env(ray_head)
    job_id = f"cs3-fail-{uuid.uuid4().hex[:8]}"
    submitted = subprocess.run(["ray", "job", "submit", "--address", ray_head.dashboard_url, "--no-wait",
                                "--submission-id", job_id, "--", "python", "-c",
                                "print('about to fail'); raise SystemExit(3)"],
                               env=env, capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    proc = run_cs3(["jobs", "logs", job_id, "-f", "--address", ray_head.dashboard_url], env=env, cwd=ROOT)
    assert proc.returncode == 1 and "about to fail" in proc.stdout, proc.stderr[-2000:]
    assert f"job {job_id} ended FAILED" in proc.stderr and "Traceback" not in proc.stderr
