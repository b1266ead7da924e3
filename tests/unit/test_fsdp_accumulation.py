"""FSDP2 with gradient accumulation: gradients stay sharded between micro-batches unless
parallel.fsdp_unsharded_accumulation asks to hold them whole; both give the same losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from cs3ray.config import load_config
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology

from helpers.core import MODEL, global_batches
from helpers.ranks import gloo_ranks

STEPS, ACCUM = 3, 2
PRECISIONS = ("fp32", "bf16", "fp16")
TOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}


def _held_gradient_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(unsharded, sharded) gradient bytes FSDP2 holds for the model's parameters right now."""
    unsharded = sharded = 0
    for module in model.modules():
        if not hasattr(module, "_get_fsdp_state"):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group else []:
            whole = [param.unsharded_accumulated_grad, getattr(getattr(param, "_unsharded_param", None), "grad", None)]
            unsharded += sum(g.numel() * g.element_size() for g in whole if g is not None)
            grad = param.sharded_param.grad
            if grad is not None:
                local = grad.to_local()
                sharded += local.numel() * local.element_size()
    return unsharded, sharded


def _rank(rank: int, world: int, results: dict, batches) -> None:
    for precision in PRECISIONS:
        for mode in ("sharded", "unsharded", "int8"):
            extra = {"sharded": [], "unsharded": ["parallel.fsdp_unsharded_accumulation=true"],
                     "int8": ["compression.codec=int8"]}[mode]
            if mode == "int8" and precision != "fp32":
                continue
            cfg = load_config(None, MODEL + [f"cluster.workers={world}", "parallel.strategy=fsdp",
                                             f"precision={precision}", f"train.grad_accum={ACCUM}", *extra])
            core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, 1, ("n0",) * world, 1))
            n_params = sum(p.numel() for p in core.model.parameters())  # DTensors: the global count
            losses, held = [], []
            for gb in batches:
                parts = [gb[rank::world][i::ACCUM] for i in range(ACCUM)]

                def next_batch(parts=parts, held=held, core=core):
                    if len(parts) < ACCUM:  # after a micro-batch's backward, before the next one
                        held.append(_held_gradient_bytes(core.model))
                    return parts.pop(0)

                loss, _ = core.step(next_batch, lr=cfg.train.lr)
                t = torch.tensor([loss], dtype=torch.float64)
                dist.all_reduce(t)
                losses.append(float(t) / world)
            results[f"{mode}-{precision}"] = {"losses": losses, "held": held, "params": n_params,
                                              "comm": core.comm_stats()}


@pytest.fixture(scope="module")
def runs():
    results = gloo_ranks(_rank, 2, global_batches(STEPS, rows=8))
    for r in results.values():
        assert "error" not in r, r["error"]
    return results[0]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradients_stay_sharded_between_micro_batches_unless_asked(runs, precision):
    sharded, whole = runs[f"sharded-{precision}"], runs[f"unsharded-{precision}"]
    full_fp32 = 4 * sharded["params"]
    assert len(sharded["held"]) == STEPS * (ACCUM - 1)
    for unsharded_bytes, shard_bytes in sharded["held"]:
        assert unsharded_bytes == 0 and 0 < shard_bytes <= 0.55 * full_fp32
    # Opt-in: FSDP2 holds each parameter's whole gradient (in its reduce dtype, fp32) across micro-batches.
    for unsharded_bytes, _ in whole["held"]:
        assert unsharded_bytes >= full_fp32


@pytest.mark.parametrize("precision", PRECISIONS)
def test_both_accumulations_give_the_same_losses(runs, precision):
    a, b = runs[f"sharded-{precision}"]["losses"], runs[f"unsharded-{precision}"]["losses"]
    assert len(a) == STEPS and all(math.isfinite(x) for x in a)
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) < TOL[precision], (a, b)


def test_compressed_reduce_scatter_counts_one_sync_per_optimizer_step(runs):
    comm = runs["int8-fp32"]["comm"]
    assert comm["syncs"] == STEPS and comm["bytes_sent"] > 0 and comm["wire_ratio"] < 0.3
