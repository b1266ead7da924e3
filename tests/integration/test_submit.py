"""`cs3 submit` and `cs3 jobs` against the session's `ray start --head` (token auth on): a short run is submitted,
its logs followed to the end, listed and inspected; a relative run.dir lands where `cs3 submit` ran; a wrong
token, an unreachable address and an unknown job are one line each, exit 2; a credential is refused before it
reaches the job table."""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid

import pytest

from conftest import ROOT, run_cs3

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.steps=2", "train.warmup_steps=0", "train.eval_every=2", "train.log_every=1",
         "train.eval_batches=1", "checkpoint.every=2", "cluster.workers=1", "data.max_bytes=200000",
         "precision=fp32"]


@pytest.mark.slow
def test_submit_follows_a_run_to_the_end_and_jobs_lists_it(ray_head, tmp_path):
    env = {k: v for k, v in ray_head.env().items() if k != "RAY_ADDRESS"}
    work = tmp_path / "project"  # a user's folder: their config, no jobs/train.py (cs3 train runs the job)
    (work / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs/tiny.yaml", work / "configs/tiny.yaml")
    proc = run_cs3(["submit", "configs/tiny.yaml", *SMALL, "--name", "submitted", "--address", ray_head.dashboard_url],
                   env=env, cwd=work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2: validation loss" in proc.stdout  # the job's own output, followed live
    job_id = proc.stderr.split("submitted job ", 1)[1].split()[0]
    # A relative run.dir on a cluster on this machine: where `cs3 submit` ran, not in Ray's copy of the folder.
    assert (work / "runs/submitted/step-00000002/manifest.json").exists()

    listed = json.loads(run_cs3(["jobs", "ls", "--address", ray_head.address, "--json"], env=env,
                                check=True).stdout.strip().splitlines()[-1])
    assert {"id": job_id, "status": "SUCCEEDED"}.items() <= next(j for j in listed if j["id"] == job_id).items()
    status = run_cs3(["jobs", "status", job_id, "--json", "--address", ray_head.dashboard_url], env=env, check=True)
    assert json.loads(status.stdout.strip().splitlines()[-1])["status"] == "SUCCEEDED"
    logs = run_cs3(["jobs", "logs", job_id, "--address", ray_head.dashboard_url], env=env, check=True)
    assert "step 2: validation loss" in logs.stdout


def test_a_wrong_token_an_unreachable_cluster_and_an_unknown_job_are_one_line_each(ray_head):
    env = {k: v for k, v in ray_head.env().items() if k != "RAY_ADDRESS"}
    cases = [
        (["jobs", "ls", "--address", ray_head.dashboard_url], dict(env, RAY_AUTH_TOKEN="0" * 32), "refused the auth token"),
        (["submit", "configs/tiny.yaml", "--address", "http://127.0.0.1:1"], env, "cannot reach the Ray cluster"),
        (["jobs", "status", "raysubmit_nope", "--address", ray_head.dashboard_url], env, "no such job"),
        (["submit", "configs/tiny.yaml", "--address", ray_head.dashboard_url, "--working-dir", "jobs"], env,
         "outside --working-dir"),
    ]
    for args, case_env, message in cases:
        proc = run_cs3(args, env=case_env, cwd=ROOT)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr


def test_a_credential_is_refused_and_never_reaches_the_job_table(ray_head, tmp_path):
    secret = f"cs3-submit-secret-{uuid.uuid4().hex}"
    env = {k: v for k, v in ray_head.env().items() if k != "RAY_ADDRESS"}
    proc = run_cs3(["submit", "configs/tiny.yaml", *SMALL, f"storage.options.secret={secret}", "--no-wait",
                    "--address", ray_head.dashboard_url], env=env, cwd=ROOT)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "refusing the credential in 'storage.options.secret'" in lines[0] and "environment variables" in lines[0]
    assert secret not in proc.stdout + proc.stderr
    # What everyone who reaches the job API sees: Ray's own listing and cs3's.
    listed = subprocess.run(["ray", "job", "list", "--address", ray_head.dashboard_url], env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    ours = run_cs3(["jobs", "ls", "--json", "--address", ray_head.dashboard_url], env=env, check=True)
    assert secret not in listed.stdout + listed.stderr + ours.stdout + ours.stderr
