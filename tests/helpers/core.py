"""Run the compute core in N plain torch.distributed processes (gloo), no Ray: for equivalence tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cs3ray.config import load_config
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology
from cs3ray.core.state import local_optimizer

from helpers.ranks import gloo_ranks

MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64", "model.max_seq_len=32",
         "train.seq_len=16", "train.clip=1.0", "train.lr=1e-2", "train.warmup_steps=0"]


def global_batches(steps: int, rows: int, seq: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (rows, seq + 1)).astype(np.int64) for _ in range(steps)]


def run_core(overrides: list[str], rank: int, world: int, batches: list[np.ndarray], node_ids=None,
             inject_inf_at: int | None = None, inject_rank: int | None = None) -> dict[str, Any]:
    """Train on `batches` (global batches, split by data-parallel rank); return losses and memory.

    inject_inf_at: the step whose gradients overflow; on every rank, or with inject_rank only on that one
    (the others must still skip the step: the overflow check is collective).
    """
    cfg = load_config(None, MODEL + [f"cluster.workers={world}"] + overrides)
    topo = Topology(rank, world, cfg.parallel.tp, tuple(node_ids or ["n0"] * world), cfg.parallel.pp)
    core = ComputeCore(cfg, torch.device("cpu"), topo)
    losses, applied, hook = [], [], None
    for i, gb in enumerate(batches):
        per = len(gb) // topo.dp
        local = gb[topo.dp_rank * per:(topo.dp_rank + 1) * per]
        if inject_inf_at == i and inject_rank is None:
            # Make every gradient inf on this step by scaling a weight to overflow in fp16.
            for p in core.params:
                p.register_hook(lambda g: torch.full_like(g, float("inf")))
        elif inject_inf_at == i and rank == inject_rank:
            # Overflow the gradient of this rank's logits: works whatever wraps the parameters.
            def overflow(_module, _inputs, out):
                out.register_hook(lambda g: torch.full_like(g, float("inf")))
            hook = core.model.register_forward_hook(overflow)
        loss, ok = core.step(lambda batch=local: batch, lr=cfg.train.lr, track_memory=(i == 1))
        if hook is not None:
            hook.remove()
        t = torch.tensor([loss], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
            t /= world
        losses.append(float(t))
        applied.append(ok)
        if inject_inf_at == i:
            break
    core.evaluate([batches[0][: cfg.train.batch_size]])
    captured = core.state()["optim"]["state"]
    optim = local_optimizer(core.optimizer)
    # Master weights: parameters and AdamW moments stay fp32 whatever precision computes.
    master = {str(p.dtype) for p in core.params} | {str(v.dtype) for st in optim.state.values()
                                                     for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
    return {"losses": losses, "applied": applied, "memory": core.memory(), "scale": core.scaler.scale,
            "master_dtypes": sorted(master), "comm": core.comm_stats(),
            "skipped": core.scaler.skipped, "optim_entries_after_eval": len(captured),
            "trainable": len({id(p) for p in core.model.parameters()})}


def _entry(rank: int, world: int, results: dict, jobs: list[tuple], batches) -> None:
    for name, overrides, *options in jobs:
        results[name] = run_core(overrides, rank, world, batches, **(options[0] if options else {}))


def run_distributed(jobs: list[tuple], batches, world: int = 2) -> dict[str, dict]:
    """Run several (name, overrides[, run_core options]) jobs one after another in `world` processes;
    rank 0's and rank 1's results."""
    results = gloo_ranks(_entry, world, jobs, batches)
    for r in results.values():
        if "error" in r:
            raise AssertionError(r["error"])
    return {"rank0": results[0], "rank1": results.get(1, {})}


def steps_with_an_overflow(core: ComputeCore, rank: int, snapshot) -> tuple[list[bool], list[Any]]:
    """Four steps of 8-row global batches split over 2 ranks, rank 1's third step overflowing (its logits'
    gradient made inf); (whether each step was applied, `snapshot()` after each)."""
    applied, snapshots = [], []
    for i, gb in enumerate(global_batches(4, rows=8)):
        local = gb[rank * 4:(rank + 1) * 4]
        hook = None
        if i == 2 and rank == 1:
            def overflow(_module, _inputs, out):
                out.register_hook(lambda g: torch.full_like(g, float("inf")))
            hook = core.model.register_forward_hook(overflow)
        _, ok = core.step(lambda rows=local: rows, lr=1e-2)
        if hook is not None:
            hook.remove()
        applied.append(ok)
        snapshots.append(snapshot())
    return applied, snapshots
