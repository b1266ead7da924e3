"""`cs3 bench comm --ranks 2,4 --quick --json` as a user runs it: real gloo processes, every mode counted against
its formula; bad --ranks is one line and exit 2."""

import json

import pytest
from typer.testing import CliRunner

from cs3ray.bench import comm_scale
from cs3ray_cli.main import app

from conftest import run_cs3


# 6 rank processes: 10 s on a 2-core host (24 s with a test suite running beside it)
def test_quick_ranks_table_counts_bytes_and_messages_per_rank_against_each_formula():
    proc = run_cs3(["bench", "comm", "--ranks", "2,4", "--quick", "--json"], timeout=300, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "loopback" not in r and "link_gbps" not in r  # only the table runs, no emulated link
    assert [row["ranks"] for row in r["ranks"]] == [2, 4]
    for row in r["ranks"]:
        n = row["ranks"]
        modes = row["modes"]
        assert set(modes) == {"fp32_all_reduce", "int8_all_reduce", "fsdp_fp32_reduce_scatter",
                              "fsdp_int8_reduce_scatter"}
        for name, m in modes.items():
            assert m["seconds"] > 0 and m["bytes_per_rank"] > 0, (n, name)
            assert m["bytes_met"] == (abs(m["bytes_per_rank"] / m["formula_bytes_per_rank"] - 1) <= 0.10), (n, name)
            # What the kernel saw the process write holds at least what was handed over (gloo adds headers).
            assert m["wire_bytes_per_rank"] >= m["bytes_per_rank"] * 0.999, (n, name)
        # gloo's fp32 ring all-reduce: 2 (N-1)/N of the payload on each rank's sockets.
        assert modes["fp32_all_reduce"]["bytes_met"], modes["fp32_all_reduce"]
        # cs3ray's exchanges: exactly the formula in point-to-point bytes, and no more messages than a ring.
        # FSDP2's fp32 reduce-scatter goes through cs3ray's exchange on gloo (gloo's own sends an all-reduce).
        for name, per_ring in (("int8_all_reduce", 2 * (n - 1)), ("fsdp_int8_reduce_scatter", n - 1),
                               ("fsdp_fp32_reduce_scatter", n - 1)):
            m = modes[name]
            assert m["bytes_per_rank"] == m["formula_bytes_per_rank"], (n, name, m)
            assert m["messages_per_rank"] == m["ring_messages_per_rank"] == per_ring, (n, name, m)
            assert m["wire_bytes_per_rank"] < 1.05 * m["bytes_per_rank"], (n, name, m)
        # int8 sends about a quarter of fp32's bytes.
        assert modes["int8_all_reduce"]["bytes_per_rank"] < 0.27 * modes["fp32_all_reduce"]["bytes_per_rank"]
    assert r["met"] and r["not_met"] == [], r["not_met"]


@pytest.mark.parametrize("ranks", ["2,x", "1,2", "4.5", "", "2,,4", "65"])
def test_bad_ranks_is_one_line_and_exit_2(ranks):
    res = CliRunner().invoke(app, ["bench", "comm", "--ranks", ranks])
    assert res.exit_code == 2, res.output
    assert "--ranks" in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_rank_counts_parse_sorted_and_buffers_split_evenly():
    assert comm_scale.parse_ranks("16, 2,4,8,4") == [2, 4, 8, 16]
    assert comm_scale.numel_for(3, comm_scale.QUICK_NUMEL) % (3 * 256) == 0
