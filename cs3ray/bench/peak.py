"""`cs3 bench peak`: the measured matmul peak of this device (cs3ray.core.peak) in fp32 and bf16.

The two dtypes take turns for a few rounds, each round in the other order, so the bf16/fp32
ratio is paired per round (the host's drift hits both) and gets a 95% interval; each dtype's
peak is the best of its rounds, as a peak is.
"""

from __future__ import annotations

import torch

from cs3ray.core.peak import measure_peak

from . import stats


def run(threads: int, quick: bool = False, device: str = "cpu") -> dict:
    """Peak FLOP/s in fp32 and bf16 (best of the rounds) and their ratio per round (median, interval)."""
    # The default's 2 s a dtype is split over 3 rounds, so the run stays about as long as one measurement each.
    size, seconds, rounds = (1024, 0.25, 2) if quick else (2048, 0.7, 3)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = (torch.float32, torch.bfloat16) if r % 2 == 0 else (torch.bfloat16, torch.float32)
        per_round.append({str(d).removeprefix("torch."): measure_peak(d, threads, size, seconds, device) for d in order})
    fp32 = max(x["float32"] for x in per_round)
    bf16 = max(x["bfloat16"] for x in per_round)
    return {"threads": threads, "device": device, "rounds": rounds, "fp32_flops": fp32, "bf16_flops": bf16,
            "fp32_flops_rounds": [x["float32"] for x in per_round],
            "bf16_flops_rounds": [x["bfloat16"] for x in per_round],
            **stats.summarize("bf16_over_fp32", [x["bfloat16"] / x["float32"] for x in per_round]),
            "targets": {}, "verdicts": {}, "method": stats.METHOD}
