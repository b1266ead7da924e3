"""`cs3 bench peak`: the measured matmul peak of this device (cs3ray.core.peak) in fp32 and bf16."""

from __future__ import annotations

import torch

from cs3ray.core.peak import measure_peak


def run(threads: int, quick: bool = False, device: str = "cpu") -> dict:
    """Peak FLOP/s in fp32 and bf16 (and their ratio)."""
    size, seconds = (1024, 0.5) if quick else (2048, 2.0)
    fp32 = measure_peak(torch.float32, threads, size, seconds, device)
    bf16 = measure_peak(torch.bfloat16, threads, size, seconds, device)
    return {"threads": threads, "device": device, "fp32_flops": fp32, "bf16_flops": bf16,
            "bf16_over_fp32": bf16 / fp32}
