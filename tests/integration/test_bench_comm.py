"""`cs3 bench comm --quick --json` as a user runs it: every figure measured and sane, no namespace left behind."""

import json
import math
import os

import pytest

from cs3ray.bench import comm, netns

from conftest import run_cs3

TOP = ("p2p_bidir_gbps", "busbw_gloo_gbps", "busbw_cs3_gbps", "bw_utilization")


@pytest.mark.slow
def test_quick_run_measures_loopback_the_emulated_link_and_every_codec():
    proc = run_cs3(["bench", "comm", "--quick", "--json"], timeout=300, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    lo = r["loopback"]
    assert all(lo[k] > 0 for k in TOP) and lo["busbw_shm_gbps"] > 0 and r["shm_speedup"] > 0
    assert set(lo["by_size"]) == {str(m) for m in comm.QUICK_SIZES_MIB}
    if netns.unavailable() is None:
        assert r["link_skipped"] is None and r["link_gbps"] == 1.0
        # Shaped to 1 Gb/s: each direction carries about that, never much more.
        assert 0.5 < r["p2p_bidir_gbps"] < 1.3 and 0 < r["busbw_cs3_gbps"] < 1.3
        assert all(r[k] > 0 for k in TOP)
        # Every namespace of the run is deleted (those of a live concurrent run may exist).
        stale = [n for n in netns.ours() if not os.path.exists(f"/proc/{n[len(netns.PREFIX):].split('-')[0]}")]
        assert stale == []
    else:
        assert r["link_skipped"] and all(r[k] is None for k in (*TOP, "link_gbps"))
    assert set(r["codecs"]) == set(comm.CODECS)
    for name, c in r["codecs"].items():
        # Compressed on the wire: no codec fell back to fp32.
        assert 0 < c["wire_ratio"] < 1 and c["quant_ms_per_mib"] > 0 and c["loopback_speedup"] > 0, name
        assert (c["link_speedup"] is None) == (r["link_skipped"] is not None), name
    assert r["codecs"]["int8"]["wire_ratio"] <= 0.26 and r["codecs"]["int4_sparse"]["wire_ratio"] <= 0.0625
    # Every ratio of the paired rounds with its interval, every target judged (a skipped link's: inconclusive).
    assert set(r["verdicts"]) == set(r["targets"]) == {*comm.LINK_TARGETS, *comm.LOOPBACK_TARGETS}
    assert all(v in ("met", "not met", "inconclusive") for v in r["verdicts"].values())
    for name in r["targets"]:
        if name in r["verdict_reasons"]:
            assert r[name] is None and r["verdicts"][name] == "inconclusive", name
            continue
        low, high = r[f"{name}_interval"]
        assert len(r[f"{name}_rounds"]) == comm.QUICK_REPS and (math.isnan(low) or low <= r[name] <= high), name
