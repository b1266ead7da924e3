"""Keeping the optimisation the same when the number of workers changes.

An elastic run trains with anywhere between min and max workers. The global batch (samples
per optimizer step) is fixed at its size for max workers, so the loss curve and the LR
schedule do not notice a resize: fewer workers accumulate more micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from cs3ray.config import JobConfig
from cs3ray.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int  # samples per worker per forward
    grad_accum: int  # micro-batches per optimizer step
    global_samples: int  # samples per optimizer step, all workers together


def global_samples(cfg: JobConfig) -> int:
    """Samples per optimizer step: train.batch_size x train.grad_accum x the largest data-parallel width."""
    p = cfg.parallel
    return cfg.train.batch_size * cfg.train.grad_accum * (cfg.cluster.max_workers // (p.tp * p.pp))


def plan_batch(cfg: JobConfig, dp: int) -> BatchPlan:
    """Micro-batch and accumulation for `dp` data-parallel workers that keep the global batch.

    Prefers the configured micro-batch; when it does not divide, takes the fewest accumulation
    steps whose micro-batch is no larger than configured.
    """
    total = global_samples(cfg)
    for accum in range(1, total + 1):
        if total % (dp * accum) == 0 and total // (dp * accum) <= cfg.train.batch_size:
            return BatchPlan(total // (dp * accum), accum, total)
    raise UserError(f"a global batch of {total} samples cannot be split evenly over {dp} workers; "
                    f"choose train.batch_size and cluster.workers so that it can.")
