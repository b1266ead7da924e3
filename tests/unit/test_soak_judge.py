"""The soak's sampler and its judgement of growth, on synthetic series and on real processes (the soak itself:
tests/integration/test_soak.py, marked slow)."""

from __future__ import annotations

import random
import subprocess
import sys
import uuid

import pytest

from cs3ray.ops.soak import fit, judge, judge_all, parse_duration, ray_processes, sample_node

GIB = float(1 << 30)
MEMORY = 24 * GIB  # a node of 24 GiB: a series may grow 2.4 GiB in 72 h


def minutes(n: int, every_s: float = 60.0) -> list[float]:
    return [i * every_s for i in range(n)]


def test_the_slope_of_a_line_and_the_interval_of_noise():
    t = minutes(20)
    slope, low, high = fit(t, [100.0 + 30.0 * x / 3600 for x in t])
    assert slope == pytest.approx(30.0) and low == pytest.approx(30.0) and high == pytest.approx(30.0)
    rng = random.Random(0)
    slope, low, high = fit(t, [500.0 + rng.gauss(0, 5) for _ in t])
    assert low < 0 < high


def test_a_steady_leak_fails_and_noise_or_a_start_up_step_does_not():
    t = minutes(20)
    rng = random.Random(1)
    leak = [400e6 + 50e6 * x / 3600 + rng.gauss(0, 2e6) for x in t]  # 50 MB an hour: 3.6 GB in 72 h
    assert judge("n:1 worker", "rss_bytes", t, leak, MEMORY).failed
    slow = [400e6 + 5e6 * x / 3600 + rng.gauss(0, 2e6) for x in t]  # 5 MB an hour: 360 MB in 72 h
    assert not judge("n:1 worker", "rss_bytes", t, slow, MEMORY).failed
    noisy = [400e6 + rng.gauss(0, 40e6) for _ in t]
    assert not judge("n:1 worker", "rss_bytes", t, noisy, MEMORY).failed
    # Start-up: the first samples climb, then it levels off (the warm-up is not fitted).
    step = [100e6, 300e6, 380e6, 400e6] + [400e6 + rng.gauss(0, 1e6) for _ in t[4:]]
    assert not judge("n:1 worker", "rss_bytes", t, step, MEMORY).failed


def test_descriptors_and_threads_may_not_double_in_72_hours():
    t = minutes(20)
    fds = [50.0 + i for i in range(20)]  # one more a minute
    got = judge("n:1 raylet", "fds", t, fds, MEMORY)
    assert got.failed and got.limit == 50.0 and got.projected_72h == pytest.approx(72 * 60)
    assert not judge("n:1 raylet", "threads", t, [30.0] * 20, MEMORY).failed


def test_series_of_processes_seen_only_at_the_end_are_left_out():
    samples = [(float(i * 60), [{"process": "n:1 raylet", "metric": "fds", "value": 10.0}]
                + ([{"process": "n:2 late", "metric": "fds", "value": float(i)}] if i >= 17 else []))
               for i in range(20)]
    fits = judge_all(samples, {"n": MEMORY})
    assert [(f.process, f.samples) for f in fits] == [("n:1 raylet", 16)]  # 20 less the warm-up's 4


def test_durations():
    assert [parse_duration(x) for x in ("90s", "20m", "1.5h", "45")] == [90.0, 1200.0, 5400.0, 45.0]
    for bad in ("abc", "0s", "-1m", ""):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_the_sampler_sees_a_sessions_process_tree_and_nothing_else(tmp_path):
    session = f"session_test_{uuid.uuid4().hex[:8]}"
    # A process naming the session (as raylet and the GCS do) whose child does not (as workers).
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code, f"--session_dir=/tmp/ray/{session}"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import time

        for _ in range(100):
            found = ray_processes(session)
            if len(found) == 2:
                break
            time.sleep(0.05)
        pids = {p.pid for p in found}
        assert parent.pid in pids and len(pids) == 2 and other.pid not in pids
        rows = sample_node("n", session)
        totals = {r["metric"]: r["value"] for r in rows if r["process"] == "n: all Ray processes"}
        assert totals["rss_bytes"] > 0 and totals["threads"] >= 2 and totals["fds"] >= 0
        assert {r["process"].split(" ")[0] for r in rows if "all Ray" not in r["process"]} == \
            {f"n:{pid}" for pid in pids}
    finally:
        for p in (parent, other):
            p.kill()
            p.wait()
        for child in found:
            try:
                child.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
