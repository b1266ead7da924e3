"""`cs3 bench comm`'s pure parts: bus bandwidth as nccl-tests defines it, the per-size summary, the tbf depth."""

import subprocess

import pytest

from cs3ray.bench import comm, netns


def test_busbw_is_algbw_times_2_n_minus_1_over_n():
    # 1 GB in 1 s is 8 Gb/s of algbw; a 2-rank all-reduce carries all of it on each link, 8 ranks 7/4 of it.
    assert comm.gbps(1e9, 1.0) == pytest.approx(8.0)
    assert comm.busbw_gbps(1e9, 1.0, 2) == pytest.approx(8.0)
    assert comm.busbw_gbps(1e9, 1.0, 8) == pytest.approx(14.0)
    assert comm.busbw_gbps(1e9, 2.0, 4) == pytest.approx(6.0)


def test_summary_reports_the_largest_size_and_the_worst_utilization_with_its_interval():
    mib = comm.MIB * 8 / 1e9  # Gb in one MiB
    # Seconds per paired round: at 16 MiB cs3ray's all-reduce takes about twice the point-to-point time.
    raw = {"sizes": {"4": {"p2p_bidir_s": [4 * mib] * 3, "gloo_s": [8 * mib] * 3, "cs3_s": [6 * mib] * 3,
                           "shm_s": [2 * mib] * 3},
                     "16": {"p2p_bidir_s": [16 * mib] * 3, "gloo_s": [16 * mib] * 3,
                            "cs3_s": [30 * mib, 32 * mib, 34 * mib], "shm_s": [8 * mib] * 3}}}
    s = comm.summarize_path(raw)
    assert (s["p2p_bidir_gbps"], s["busbw_gloo_gbps"], s["busbw_cs3_gbps"]) == pytest.approx((1.0, 1.0, 0.5))
    assert s["bw_utilization"] == pytest.approx(0.5) and s["bw_utilization_size_mib"] == 16
    low, high = s["bw_utilization_interval"]
    assert low < 0.5 < high and s["bw_utilization_rounds"] == pytest.approx([16 / 30, 0.5, 16 / 34])
    assert s["by_size"]["4"]["bw_utilization_interval"] == pytest.approx([4 / 6, 4 / 6])
    assert s["busbw_shm_gbps"] == pytest.approx(2.0) and set(s["by_size"]) == {"4", "16"}
    assert s["shm_speedup"] == pytest.approx(2.0) and s["shm_speedup_size_mib"] in (4, 16)


def test_codec_speedups_are_per_round_and_skipped_link_targets_are_inconclusive():
    raw = {"codecs": {"gloo_s": [1.0, 1.2, 1.1], **{c: {"s": [0.5, 0.6, 0.5]} for c in comm.CODECS}}}
    loop = comm.codec_speedups(raw, "loopback")
    assert loop["int8_loopback_speedup_rounds"] == pytest.approx([2.0, 2.0, 2.2])
    result = {**loop, "link_skipped": "needs root", "shm_speedup": 1.0, "shm_speedup_interval": [0.9, 1.1]}
    r = result | comm.judged(result)
    assert set(r["verdicts"]) == set(r["targets"]) == {*comm.LINK_TARGETS, *comm.LOOPBACK_TARGETS}
    assert r["verdicts"]["int8_loopback_speedup"] == "met" and r["verdicts"]["shm_speedup"] == "not met"
    assert all(r["verdicts"][k] == "inconclusive" and r["verdict_reasons"][k] == "needs root"
               for k in comm.LINK_TARGETS)
    assert "bw_utilization (>= 0.9): inconclusive, link skipped" in comm.verdict_line(r)


def test_token_bucket_holds_4_ms_of_the_rate():
    assert netns.tbf_burst_bytes(1.0) == 500_000
    assert netns.tbf_burst_bytes(0.01) == 64 * 1024


def test_without_root_the_link_is_skipped_with_one_line(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    reason = netns.unavailable()
    assert "needs root" in reason and "\n" not in reason


@pytest.mark.skipif(netns.unavailable() is not None, reason="needs root and iproute2")
def test_the_link_and_a_killed_run_s_namespaces_are_deleted():
    dead = f"{netns.PREFIX}999999999-a"  # no such pid
    subprocess.run(["ip", "netns", "add", dead], check=True)
    with netns.Link(1.0) as link:
        assert dead not in netns.ours() and set(link.ns) <= set(netns.ours())
        shaped = subprocess.run([*link.exec_prefix(0), "tc", "qdisc", "show", "dev", link.dev[0]],
                                capture_output=True, text=True, check=True).stdout
        assert "tbf" in shaped and "1Gbit" in shaped
    assert not set(link.ns) & set(netns.ours())


def test_a_rank_that_fails_is_reported_as_the_first_error():
    plan = {"sizes_mib": [], "reps": 1, "codec_mib": 1, "codecs": ["zstd"], "shm": False}
    r = comm._run_ranks(plan, None)
    assert "unknown compression codec 'zstd'" in r["first_error"], r
