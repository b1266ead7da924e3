"""`cs3 up` / `cs3 status` / `cs3 down` on this machine: two nodes with labels and token auth, idempotent, used
by the other commands without --address, and stopped without touching any other Ray (the session's head)."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_cs3


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.slow
def test_up_status_down_are_idempotent_and_touch_only_their_own_cluster(ray_head, tmp_path):
    env = {k: v for k, v in ray_head.env().items() if k != "RAY_ADDRESS"}
    env["CS3_HOME"] = str(tmp_path / "home")
    none = run_cs3(["status"], env=env)
    assert none.returncode == 2 and "start one with `cs3 up`" in none.stderr
    try:
        first = _json(run_cs3(["up", "--workers", "1", "--num-cpus", "2", "--labels", "zone=a,tier=cpu", "--json"],
                              env=env, timeout=240))
        assert first["started"] and first["nodes"] == 2
        again = _json(run_cs3(["up", "--json"], env=env))
        assert not again["started"] and again["address"] == first["address"]

        status = _json(run_cs3(["status", "--json"], env=env))  # no --address: the recorded cluster
        assert status["address"] == first["address"] and len(status["nodes"]) == 2
        assert all(n["labels"] == {"zone": "a", "tier": "cpu"} for n in status["nodes"])
        assert status["resources"]["CPU"]["total"] == 4 and status["trainings"] == [] and status["serve_apps"] == {}
        jobs = run_cs3(["jobs", "ls", "--json"], env=env)  # the job API of the same cluster: `cs3 status` was a driver
        assert [j["status"] for j in _json(jobs) if "cs3 status" in j["entrypoint"]] == ["SUCCEEDED"]
        assert first["dashboard"] in jobs.stderr
    finally:
        record = json.loads((tmp_path / "home/cluster.json").read_text())
        stopped = run_cs3(["down"], env=env, timeout=120)
    assert stopped.returncode == 0 and f"stopped the cluster at {first['address']}" in stopped.stdout
    assert not any(_running(p) for p in record["pids"])
    assert "no cluster started by `cs3 up`" in run_cs3(["down"], env=env).stdout
    assert ray_head.proc.poll() is None  # the session's head (another Ray on this machine) still runs
