"""`cs3 bench balance --quick`: a straggler rank is given fewer rows, and the JSON holds the figures.

The straggler here shares its core with another process (only its compute time, run plus run-queue delay,
shows it); the other kind, a rank that burns CPU per row, is the same bench with another slowdown, and its
measure (the thread's CPU time) is tested in tests/unit/test_busy.py."""

from __future__ import annotations

import json

import pytest

from conftest import run_cs3


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """One working folder for both stragglers: the second run finds the shards the first prepared."""
    return tmp_path_factory.mktemp("balance")


@pytest.mark.slow
@pytest.mark.parametrize("straggler", ["contention"])
def test_quick_run_resplits_towards_the_faster_rank(bench_dir, straggler):
    proc = run_cs3(["bench", "balance", "--quick", "--straggler", straggler, "--json"], cwd=bench_dir, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["straggler"] == straggler
    for key in ("unbalanced_tokens_per_s", "balanced_tokens_per_s", "balanced_speedup"):
        assert r[key] > 0
    before, after = r["shares"]["before"], r["shares"]["after"]
    assert before == [16, 16] and sum(after) == 32 and after[0] > after[1]  # rank 1 is the slow one
    assert len(r["rank_utilization"]["before"]) == len(r["rank_utilization"]["after"]) == 2
    assert set(r["verdicts"]) == set(r["targets"]) == {"balanced_speedup", "slow_rank_utilization_after"}
    assert set(r["verdicts"].values()) <= {"met", "not met", "inconclusive"}
    low, high = r["balanced_speedup_interval"]
    assert len(r["balanced_speedup_rounds"]) >= 3 and low <= high
    assert r["seeds_utilization"] == {"before": 0.68, "after": 0.92}


def test_an_unknown_straggler_is_one_line_and_exit_2():
    proc = run_cs3(["bench", "balance", "--straggler", "sleepy"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--straggler must be one of burn, contention" in proc.stderr
