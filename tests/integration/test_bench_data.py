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
    for name in ("prepare_ratio", "cold_over_ray_data_read", "cold_steady_over_ray_data", "warm_steady_over_ray_data"):
        low, high = r[f"{name}_interval"]
        assert len(r[f"{name}_rounds"]) == 2 and low <= r[name] <= high, name
    assert r["prepare_tokens"] > 100_000 and r["tokenizer"].startswith("bpe (vocab 4096")
    assert math.isclose(r["prepare_ray_data_mb_s_per_core"] * r["cores"], r["prepare_ray_data_mb_s"], rel_tol=0.01)
    assert r["prepare_single_peak_rss_mb"] >= 0
    # (b) read a synthesized set: --quick's 16 MB in 1 MB shards of 2048 samples, through one s3fs on both sides.
    assert r["dataset_mb"] >= 16 and r["train_shards"] >= 16 and r["train_samples"] == r["train_shards"] * 2048
    assert r["read_seq_len"] == 256 and 1.0 <= r["shard_mb"] < 1.1 and r["latency_ms"] == 20.0
    assert r["filesystem"].startswith("s3fs") and "PyFileSystem(FSSpecHandler)" in r["filesystem"]
    # Ray Data at the best of the settings tried; each reader's startup apart from its steady rate, fitted on the
    # whole set and a part-sized one (its first quarter) read every round.
    assert len(r["ray_data_settings_tried"]) >= 3 and r["ray_data_best"] in r["ray_data_settings_tried"]
    assert r["ray_data_settings_ranked_by"] == "mb_s"  # --quick: one read of each (the default fits two)
    assert r["read_part_shards"] == r["train_shards"] // 4
    for reader in ("ray_data", "cs3_cold", "cs3_warm"):
        assert r[f"{reader}_startup_s"] >= 0 and r[f"{reader}_steady_mb_s"] > 0, reader
        assert r[f"{reader}_first_batch_s"] > 0, reader
        assert {len(r[f"read_runs_{k}"][reader]) for k in ("mb_s", "steady_mb_s", "startup_s")} == {2}, reader
    # The endpoint's CPU share was measured for every reader; the warm epoch reads L2, not the store.
    assert set(r["endpoint_cpu_fraction"]["proxy"]) == {"ray_data", "cs3_cold", "cs3_warm"}
    assert r["proxy_cpu_fraction"] == max(r["endpoint_cpu_fraction"]["proxy"].values())
    requests = r["s3_requests_per_epoch"]
    assert requests["cs3_cold"] >= r["train_shards"] > requests["cs3_warm"] and requests["ray_data"] >= r["train_shards"]
    assert {k: len(v) for k, v in r["train_runs_tokens_per_s"].items()} == {"ray_data": 1, "direct": 1}
    assert r["targets"] == data.TARGETS and set(r["verdicts"]) == set(data.TARGETS)
    assert all(v in ("met", "not met", "inconclusive") for v in r["verdicts"].values())
    assert r["verdicts"]["ray_data_loader_ratio"] == "inconclusive"
    assert all(len(row) == 5 for row in data.rows(r))
