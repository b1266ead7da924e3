"""`cs3 bench compress --quick`: every codec and peer trains from 2 seeds on 2 real gloo ranks; no codec falls back
to fp32; each codec's paired held-out delta has an interval and a non-inferiority verdict."""

import json
import math

import pytest

from cs3ray.bench import compress
from cs3ray.bench.report import measured
from cs3ray.config.schema import DgcConfig

FIELDS = {"final_loss", "loss_delta_pct", "heldout_loss", "heldout_loss_delta_pct", "heldout_loss_delta_pct_interval",
          "wire_ratio", "overlap_fraction", "state_bytes_per_worker", "verdict", "seeds"}
VERDICTS = {"no worse", "worse", "inconclusive"}


def _within(value, interval):
    low, high = interval
    return len(interval) == 2 and (not math.isfinite(low) or low <= value <= high)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_quick_run_measures_every_codec_and_its_peers(precision):
    r = measured("compress", compress.run, quick=True, overrides=(f"precision={precision}",), log=lambda _line: None)
    json.dumps(r)  # the --json line
    ddp, fsdp = r["codecs"], r["fsdp"]["codecs"]
    assert set(ddp) == set(compress.DDP_CODECS) and set(fsdp) == set(compress.FSDP_CODECS)
    for name, c in [*ddp.items(), *(("fsdp " + k, v) for k, v in fsdp.items())]:
        assert FIELDS <= set(c), name
        assert math.isfinite(c["final_loss"]) and math.isfinite(c["loss_delta_pct"]), name
        assert math.isfinite(c["heldout_loss"]) and math.isfinite(c["heldout_loss_delta_pct"]), name
        assert c["state_bytes_per_worker"] > 0, name
        assert c["verdict"] in VERDICTS and _within(c["heldout_loss_delta_pct"], c["heldout_loss_delta_pct_interval"]), name
        # Every arm but the first-seed-only peer ran from both seeds, each paired with its own seed's none.
        expected = 1 if name in compress.FIRST_SEED_ONLY else r["seeds"]
        assert c["seeds"] == expected and len(c.get("heldout_loss_delta_pct_rounds", [0])) == expected, name
    assert r["seeds"] == compress.QUICK_SEEDS == 2 and r["seeds_run"] == 2
    for table in (r, r["fsdp"]):  # the noise floor: the near-lossless bf16 peer's own paired delta
        assert _within(table["noise_floor_pct"], table["noise_floor_pct_interval"])
        assert math.isfinite(table["seed_spread_pct"])
    # Every target has a verdict in the three words, judged from an interval of its own figure.
    assert set(r["verdicts"]) == set(r["targets"]) and len(r["targets"]) == 8
    assert set(r["verdicts"].values()) <= {"met", "not met", "inconclusive"}
    for name in r["targets"]:
        assert _within(r[name], r[f"{name}_interval"]), name
    for table in (ddp, fsdp):
        # Compressed on the wire every step (DDP: after the process's first sync, in fp32 over DDP's initial
        # buckets): no silent fallback to an fp32 sync.
        first = 1 if table is ddp else 0
        steps = r["steps"]
        # int4_sparse: within DGC's warm-up the whole --quick run, so at most its first (densest) share's bytes.
        sparse = compress.sparse_wire_ratio(DgcConfig().warmup_density) + 0.01
        for name, limit in (("int8", 0.3), ("int4_sparse", sparse)):
            assert (steps * table[name]["wire_ratio"] - first) / (steps - first) < limit, name
        assert table["none"]["wire_ratio"] == 1.0 and table["none"]["loss_delta_pct"] == 0.0
        assert table["none"]["heldout_loss_delta_pct"] == 0.0
        # Error feedback keeps an fp32 residual per rank: counted in the state.
        assert table["int8"]["residual_bytes"] > 0
        assert table["int8"]["state_bytes_per_worker"] > table["none"]["state_bytes_per_worker"]
    assert ddp["torch_bf16_hook"]["wire_ratio"] == 0.5
    # PowerSGD runs at the rank whose bytes are int4_sparse's (after its first, fp32, step).
    psgd = ddp[compress.POWERSGD]
    assert psgd["powersgd_rank"] >= 1
    steps = r["steps"]
    assert abs((steps * psgd["wire_ratio"] - 1) / (steps - 1) / psgd["matched_wire_ratio"] - 1) < 0.2
    # torch's per-tensor quantization all-gathers a uint8 per value (and its scale and zero point).
    assert 0.25 <= ddp["torch_quant_pertensor_hook"]["wire_ratio"] < 0.251
    assert fsdp["torch_fsdp_reduce_bf16"]["wire_ratio"] == 0.5
    # Overlap is measured (step, compute alone, communication alone) for every run, FSDP2's too.
    for name, c in [*ddp.items(), *(("fsdp " + k, v) for k, v in fsdp.items())]:
        assert 0.0 <= c["overlap_fraction"] <= 1.0 and c["comm_s"] > 0 and c["compute_s"] > 0, name
    assert all(len(row) == len(compress.COLUMNS) for row in compress.rows(r))
