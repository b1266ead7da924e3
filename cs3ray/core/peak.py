"""The measured matmul peak of this device with a given thread count, which MFU is computed against.

MFU is only honest against a peak measured on the same machine with the same threads, so
this times large square GEMMs (the best case for any kernel library). On a CUDA device the
products are timed on the GPU itself (CUDA events around a burst of them), not by the host's clock.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

# The instruction sets that decide a CPU's matmul speed per dtype (a bench prints which it ran on).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of CPU_FEATURES this host's CPU has (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [name for name in CPU_FEATURES if name in flags]


# A GPU's peak needs products that fill every SM and hide launch latency (a 1024^3 product takes
# microseconds on a datacenter GPU): a CUDA measurement uses at least this size, in bursts of CUDA_BURST.
CUDA_SIZE = 8192
CUDA_BURST = 10


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def _cuda_peak(dtype: torch.dtype, size: int, seconds: float, device: torch.device) -> float:
    """Best FLOP/s of bursts of (size x size) products on `device`, each burst timed by CUDA events."""
    with torch.cuda.device(device):
        gen = torch.Generator(device).manual_seed(0)
        a = torch.randn(size, size, device=device, generator=gen).to(dtype)
        b = torch.randn(size, size, device=device, generator=gen).to(dtype)
        out = torch.empty(size, size, device=device, dtype=dtype)
        for _ in range(3):  # cuBLAS picks its kernel and the clocks ramp up
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = 0.0
        deadline = time.perf_counter() + seconds
        while True:  # at least one burst, however short `seconds` is
            start.record()
            for _ in range(CUDA_BURST):
                torch.matmul(a, b, out=out)
            end.record()
            end.synchronize()
            best = max(best, CUDA_BURST * 2 * size**3 / (start.elapsed_time(end) / 1e3))  # elapsed_time: ms
            if time.perf_counter() >= deadline:
                break
        del a, b, out
        torch.cuda.empty_cache()  # the operands' GiB go back to the device before the training they measure for
    return best


def measure_peak(dtype: torch.dtype, threads: int, size: int = 2048, seconds: float = 2.0,
                 device: str = "cpu", clock: Callable[[], float] = time.perf_counter) -> float:
    """Best sustained FLOP/s of (size x size) @ (size x size) in `dtype`, timed by `clock`; on a CUDA
    device by CUDA events, with products of at least CUDA_SIZE (`threads` and `clock` do not apply)."""
    if torch.device(device).type == "cuda":
        return _cuda_peak(dtype, max(size, CUDA_SIZE), seconds, torch.device(device))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    # Its own generator: measuring inside a worker must not advance the training RNG streams.
    gen = torch.Generator(device).manual_seed(0)
    try:
        a = torch.randn(size, size, device=device, generator=gen).to(dtype)
        b = torch.randn(size, size, device=device, generator=gen).to(dtype)
        t0 = clock()
        _product(a, b)  # warm up kernels and caches
        # A dtype the device emulates (fp16 on most CPUs, bf16 without AVX512-BF16) takes seconds
        # per product: then one warm-up and single timed products keep the measurement to its budget.
        reps = 4 if clock() - t0 < seconds / 8 else 1
        for _ in range(2 if reps > 1 else 0):
            _product(a, b)
        best = 0.0
        deadline = clock() + seconds
        while clock() < deadline:
            t0 = clock()
            for _ in range(reps):
                _product(a, b)
            best = max(best, reps * 2 * size**3 / (clock() - t0))
        return best
    finally:
        torch.set_num_threads(old)
