"""Model FLOPs utilisation: useful model FLOPs per second over the device's measured peak."""

from __future__ import annotations


def model_flops_per_step(flops_per_token: float, tokens_per_step: int) -> float:
    """FLOPs one optimizer step does on the model (all workers together)."""
    return flops_per_token * tokens_per_step


def mfu(tokens_per_s: float, flops_per_token: float, workers: int, peak_flops_per_worker: float) -> float:
    """Fraction (0-1) of the workers' combined peak that goes into model FLOPs.

    Recomputation (activation checkpointing) and padding are not counted as useful work,
    so turning them on lowers MFU, as it should.
    """
    if peak_flops_per_worker <= 0 or workers <= 0:
        return 0.0
    return tokens_per_s * flops_per_token / (workers * peak_flops_per_worker)
