"""Ratios over rounds (cs3ray.bench.stats): a median, a 95% interval, and a verdict that can say inconclusive."""

from __future__ import annotations

import math
import random

import pytest

from cs3ray.bench import stats


def test_identical_rounds_have_a_point_interval_and_a_clear_verdict():
    low, high = stats.ratio_interval([0.97, 0.97, 0.97])
    assert low == pytest.approx(0.97) and high == pytest.approx(0.97)
    assert stats.verdict((low, high), 0.98) == "not met"
    assert stats.verdict((low, high), 0.96) == "met"


def test_the_interval_is_students_t_on_the_log_ratios():
    ratios = [0.9, 1.0, 1.1]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    low, high = stats.ratio_interval(ratios)
    assert low == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)))
    assert high == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)))
    # A ratio and its inverse are equally far from 1.
    assert stats.ratio_interval([2.0, 0.5])[0] == pytest.approx(1 / stats.ratio_interval([2.0, 0.5])[1])


def test_a_target_inside_the_interval_is_inconclusive():
    # The seeds' overhead rounds of one host: 0.75, 0.92, 0.95 (median 0.92) against 0.98.
    r = stats.summarize("overhead_vs_ray_train", [0.75, 0.92, 0.95])
    assert r["overhead_vs_ray_train"] == 0.92 and r["overhead_vs_ray_train_rounds"] == [0.75, 0.92, 0.95]
    assert stats.judge(r, {"overhead_vs_ray_train": 0.98}) == {"overhead_vs_ray_train": "inconclusive"}
    assert stats.judge(r, {"overhead_vs_ray_train": 1.2}) == {"overhead_vs_ray_train": "not met"}
    assert stats.judge(r, {"overhead_vs_ray_train": 0.6}) == {"overhead_vs_ray_train": "met"}
    assert stats.shown(r, "overhead_vs_ray_train").startswith("0.92 [")


def test_lower_is_better_targets_flip_the_sides():
    interval = (40.0, 45.0)  # e.g. a p99 latency in ms against at most 50
    assert stats.verdict(interval, 50.0, higher_is_better=False) == "met"
    assert stats.verdict(interval, 42.0, higher_is_better=False) == "inconclusive"
    assert stats.verdict(interval, 30.0, higher_is_better=False) == "not met"


def test_too_few_rounds_are_inconclusive():
    assert all(math.isnan(x) for x in stats.ratio_interval([1.1]))
    assert stats.verdict(stats.ratio_interval([1.1]), 1.0) == "inconclusive"
    assert stats.verdict(stats.ratio_interval([1.1, -1.0, float("nan")]), 1.0) == "inconclusive"


def test_the_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = random.Random(0)
    true, covered, trials = 1.3, 0, 2000
    for _ in range(trials):
        low, high = stats.ratio_interval([true * math.exp(rng.gauss(0, 0.05)) for _ in range(5)])
        covered += low <= true <= high
    assert 0.93 <= covered / trials <= 0.97


def test_a_difference_gets_a_t_interval_on_the_raw_values():
    deltas = [-1.0, 0.5, 2.0]  # codec minus none, held-out loss in %, per seed
    low, high = stats.mean_interval(deltas)
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in deltas) / 2)
    assert low == pytest.approx(0.5 - 4.303 * sd / math.sqrt(3)) and high == pytest.approx(0.5 + 4.303 * sd / math.sqrt(3))
    r = stats.summarize("delta", deltas, difference=True)
    assert r["delta"] == 0.5 and r["delta_interval"] == [low, high]


def test_non_inferiority_reads_the_interval_against_the_margin():
    assert stats.noninferiority((-1.0, 1.9), 2.0) == "no worse"
    assert stats.noninferiority((2.1, 5.0), 2.0) == "worse"
    assert stats.noninferiority((0.5, 3.0), 2.0) == "inconclusive"
    assert stats.noninferiority(stats.mean_interval([1.0]), 2.0) == "inconclusive"


def test_targets_say_which_side_is_good():
    r = {**stats.summarize("p99_ms", [40.0, 42.0, 44.0], difference=True), **stats.exact("bytes_ratio", 1.0)}
    targets = {"p99_ms": {"at_most": 50.0}, "bytes_ratio": {"at_least": 1.0}}
    r.update(targets=targets, verdicts=stats.judge(r, targets))
    assert r["verdicts"] == {"p99_ms": "met", "bytes_ratio": "met"}
    assert stats.stated(targets["p99_ms"]) == "<= 50" and stats.stated(0.98) == ">= 0.98"
    line = stats.verdict_line(r)
    assert line.startswith("p99_ms 42.00 [37.") and line.endswith("bytes_ratio 1.00 [1.00, 1.00] (>= 1): met")
