"""`cs3 bench` as a user runs it: JSON on the last line, every ratio with its interval and every target
with its verdict, and a bad argument is one line with exit 2."""

import json
import math

import pytest

from cs3ray.bench import cache, ckpt, disk

from conftest import run_cs3

VERDICTS = {"met", "not met", "inconclusive"}


def _last_json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_interval(r: dict, name: str, rounds: int) -> None:
    """`name` is the median of its rounds, inside its 95% interval where that is finite."""
    low, high = r[f"{name}_interval"]
    assert len(r[f"{name}_rounds"]) == rounds
    if math.isfinite(low) and math.isfinite(high):
        assert low <= r[name] <= high


def assert_verdicts(r: dict, targets: set[str]) -> None:
    assert set(r["targets"]) == set(r["verdicts"]) == targets
    assert set(r["verdicts"].values()) <= VERDICTS


def test_bench_disk_json_and_a_bad_path_is_one_line(tmp_path):
    bad = run_cs3(["bench", "disk", "--quick", "--path", str(tmp_path / "missing")])
    assert bad.returncode == 2 and "is not an existing folder" in bad.stderr and "Traceback" not in bad.stderr
    r = _last_json(run_cs3(["bench", "disk", "--quick", "--json", "--path", str(tmp_path)], check=True))
    assert set(r) == set(disk.JSON_KEYS)
    for name in ("compute_lost_s", "lost_over_writer_cpu"):
        assert_interval(r, name, 2)
    assert_verdicts(r, set())  # it measures the host: no target


def test_bench_peak_ratio_over_alternating_rounds():
    r = _last_json(run_cs3(["bench", "peak", "--quick", "--threads", "1", "--json"]))
    assert_interval(r, "bf16_over_fp32", 2)
    assert r["fp32_flops"] == max(r["fp32_flops_rounds"]) and r["bf16_flops"] == max(r["bf16_flops_rounds"])


def test_bench_cache_rounds_and_verdicts():
    r = _last_json(run_cs3(["bench", "cache", "--quick", "--json"], timeout=300))
    assert set(r) == set(cache.JSON_KEYS) and r["rounds"] == 2
    for name in cache.TARGETS:
        assert_interval(r, name, 2)
    assert_verdicts(r, set(cache.TARGETS))
    assert r["hit_rate_half"] >= r["hit_rate_half_lru"]  # noevict keeps half the data; LRU churns


def test_bench_ckpt_rounds_and_verdicts():
    r = _last_json(run_cs3(["bench", "ckpt", "--quick", "--json"], timeout=600))
    assert set(r) == set(ckpt.JSON_KEYS)
    for name in ("sync_overhead_pct", "async_overhead_pct", "async_over_sync_overhead", "overhead_at_15_min_pct",
                 "sync_overhead_at_15_min_pct"):
        assert_interval(r, name, r["rounds"])
    # At the seeds' 15 minutes: each round's blocking seconds over 900 s (sync blocks for its whole save).
    assert r["overhead_at_15_min_pct"] == pytest.approx(100 * r["async_blocking_s"] / 900)
    assert r["overhead_at_15_min_pct"] > 0 and r["sync_overhead_at_15_min_pct"] > 0
    assert_interval(r, "restore_memory_over_storage", 2)
    assert r["incremental_over_changed_interval"] == [r["incremental_over_changed"]] * 2  # counted, not timed
    assert len(r["restore_rounds"]["memory"]) == len(r["restore_rounds"]["storage"]) == 2
    assert_verdicts(r, set(ckpt.TARGETS))
