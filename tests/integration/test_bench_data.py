"""`cs3 bench data --quick` as a user runs it: all three parts measured, the issue's keys on the JSON line."""

import json
import math

import pytest

from cs3ray.bench import data

from conftest import run_cs3


@pytest.mark.slow
def test_quick_run_measures_prepare_read_and_training():
    proc = run_cs3(["bench", "data", "--quick", "--json"], check=True)
    assert "Traceback" not in proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in data.JSON_KEYS:
        assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, key
    # One training round: its ratio is the two figures' own ratio, its interval unknown (NaN).
    assert math.isclose(r["ray_data_loader_ratio"], r["ray_data_tokens_per_s"] / r["direct_tokens_per_s"],
                        rel_tol=0.02)
    assert all(math.isnan(x) for x in r["ray_data_loader_ratio_interval"])
    # Two rounds of preparing and of reading: each ratio the median of the rounds' ratios, inside its interval.
    for name in ("prepare_ratio", "cold_over_ray_data_read"):
        low, high = r[f"{name}_interval"]
        assert len(r[f"{name}_rounds"]) == 2 and low <= r[name] <= high, name
    # (b) read the shards (a) wrote: a BPE corpus of a few MB gives a few train shards and thousands of samples.
    assert r["prepare_tokens"] > 100_000 and r["train_shards"] >= 2 and r["train_samples"] > 1_000
    assert r["tokenizer"].startswith("bpe (vocab 4096") and r["latency_ms"] == 20.0
    assert {k: len(v) for k, v in r["train_runs_tokens_per_s"].items()} == {"ray_data": 1, "direct": 1}
    assert r["targets"] == data.TARGETS and set(r["verdicts"]) == set(data.TARGETS)
    assert all(v in ("met", "not met", "inconclusive") for v in r["verdicts"].values())
    assert r["verdicts"]["ray_data_loader_ratio"] == "inconclusive"
    assert all(len(row) == 5 for row in data.rows(r))
