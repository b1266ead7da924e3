"""Model FLOPs utilisation: useful model FLOPs per second over the device's measured peak."""

from __future__ import annotations

from cs3ray.models.args import ModelArgs
from cs3ray.models.flops import train_flops_per_token


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


def stage_flops_per_token(args: ModelArgs, seq_len: int, layers: int, last: bool) -> float:
    """Training FLOPs per token of a pipeline stage of `layers` blocks (the last one also projects to the
    vocabulary): the stages of a pipeline add up to the whole model's `train_flops_per_token`."""
    output = 6.0 * args.vocab_size * args.dim
    per_block = (train_flops_per_token(args, seq_len) - output) / args.n_layers
    return layers * per_block + (output if last else 0.0)
