"""The measured matmul peak that MFU divides by: positive, and within its time budget for a slow dtype."""

from cs3ray.core.peak import measure_peak


def test_peak_is_measured_and_positive():
    import torch

    assert measure_peak(torch.float32, 1, size=256, seconds=0.1) > 1e8


def test_a_slow_dtype_keeps_the_peak_measurement_near_its_budget():
    # fp16 products are emulated on most CPUs (and slow on all): a worker training in fp16 measures
    # its peak with one warm-up and single timed products, not seven products whatever they cost.
    import time

    import torch

    a = torch.randn(512, 512).half()
    a @ a
    t0 = time.perf_counter()
    a @ a
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert measure_peak(torch.float16, 1, size=512, seconds=one / 4) > 0
    assert time.perf_counter() - t0 < 5 * one
