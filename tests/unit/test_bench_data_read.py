"""`bench data` (b)'s figures: startup and steady rate from a whole and a part-sized read, and the measurers."""

import math
import time

import pytest

from cs3ray.bench.data_read import Epoch, fit
from cs3ray.bench.loopback_s3 import ProxyProcess, s3_options
from cs3ray.bench.usage import CpuShare
from cs3ray.data.peak_rss import PeakRss


def test_fit_separates_startup_from_the_steady_rate():
    # 5 s of startup, then 100 MB/s: a quarter (250 MB) in 7.5 s, the whole GB in 15 s.
    f = fit(Epoch(4.9, 7.5, 100), 250.0, Epoch(4.9, 15.0, 400), 1000.0)
    assert math.isclose(f.startup_s, 5.0) and math.isclose(f.steady_mb_s, 100.0)
    assert math.isclose(f.mb_s, 1000 / 15) and f.first_batch_s == 4.9


def test_a_reader_that_delivers_at_the_end_gets_no_free_steady_rate():
    # Its first batch comes after nearly all its reading: the rate is still the extra MB over the extra time.
    f = fit(Epoch(7.4, 7.5, 100), 250.0, Epoch(14.9, 15.0, 400), 1000.0)
    assert math.isclose(f.steady_mb_s, 100.0) and math.isclose(f.startup_s, 5.0)


@pytest.mark.parametrize("part_s", [15.0, 16.0, 1.0])
def test_noise_claims_no_startup_and_the_whole_epochs_rate(part_s):
    # The part took as long as the whole or longer (the line falls), or so little that the line crosses below 0.
    f = fit(Epoch(0.5, part_s, 100), 250.0, Epoch(0.5, 15.0, 400), 1000.0)
    assert f.startup_s == 0.0 and math.isclose(f.steady_mb_s, 1000 / 15)


def test_peak_rss_sees_memory_held_inside_the_block():
    with PeakRss(interval_s=0.005) as peak:
        block = bytearray(64 * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page
        time.sleep(0.05)
    del block
    assert peak.growth_mb >= 48


def test_proxy_process_counts_requests_and_its_cpu_is_its_own(s3_server):
    proxy = ProxyProcess(s3_server[0], 0.0)
    try:
        import s3fs

        share = CpuShare(proxy.pid)
        share.start()
        fs = s3fs.S3FileSystem(**s3_options(proxy.url), skip_instance_cache=True)
        before = proxy.requests
        fs.ls("")  # one ListBuckets through the proxy
        assert proxy.requests > before
        assert 0.0 <= share.fraction() < 2.0
    finally:
        proxy.stop()
    assert proxy.proc.poll() is not None
