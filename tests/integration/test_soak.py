"""`cs3 validate --soak` as a smoke test (1 minute, a sample every 5 s): the work runs (training with a killed
worker, checkpoints, a served load) and every series is fitted; bad durations are one line, exit 2."""

from __future__ import annotations

import json

import pytest

from conftest import run_cs3


def test_bad_soak_durations_are_one_line():
    for args, message in ((["--soak", "abc"], "not a duration"), (["--soak", "10s", "--soak-interval", "60s"],
                                                                  "fewer than 3 samples")):
        proc = run_cs3(["validate", *args])
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_a_short_soak_runs_the_work_and_fits_every_series(tmp_path):
    proc = run_cs3(["validate", "--soak", "1m", "--soak-interval", "5s", "--json"], cwd=tmp_path, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    # The --json line: the last one that is JSON (Ray's driver may print a raylet warning to stdout after it).
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["samples"] >= 10 and r["training_steps"] > 0 and r["restarts"] >= 1 and r["checkpoints"] >= 1
    assert r["requests"] > 0 and r["errors"] == 0
    series = r["soak"]["series"]
    assert {"rss_bytes", "fds", "threads", "object_store_bytes"} <= {s["metric"] for s in series}
    assert any(s["process"].endswith("all Ray processes") for s in series)
    assert (proc.returncode == 1) == bool(r["soak"]["failed"]) == (not r["passed"])
    for s in series:
        assert {"process", "metric", "slope_per_hour", "projected_72h", "limit"} <= set(s)
