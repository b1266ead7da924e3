"""`cs3 bench balance --quick`: a rank slowed per row is given fewer rows, and the JSON holds the figures."""

from __future__ import annotations

import json

import pytest

from conftest import run_cs3


@pytest.mark.slow
def test_quick_run_resplits_towards_the_faster_rank(tmp_path):
    proc = run_cs3(["bench", "balance", "--quick", "--json"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("unbalanced_tokens_per_s", "balanced_tokens_per_s", "balanced_speedup"):
        assert r[key] > 0
    before, after = r["shares"]["before"], r["shares"]["after"]
    assert before == [16, 16] and sum(after) == 32 and after[0] > after[1]  # rank 1 is the slow one
    assert len(r["rank_utilization"]["before"]) == len(r["rank_utilization"]["after"]) == 2
