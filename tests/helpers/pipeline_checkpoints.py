"""Checkpoints across pipeline degrees and schedules: train in 2 gloo processes at pp=2 (no Ray), save, load at
pp=1 and back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import load_config, to_yaml
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology
from cs3ray.models import ByteTokenizer

from helpers.core import MODEL
from helpers.ranks import gloo_ranks


def core_for(overrides: list[str], rank: int, world: int) -> ComputeCore:
    cfg = load_config(None, MODEL + ["model.n_layers=4", f"cluster.workers={world}", "precision=fp32", *overrides])
    topo = Topology(rank, world, cfg.parallel.tp, ("n0",) * world, cfg.parallel.pp)
    return ComputeCore(cfg, torch.device("cpu"), topo)


def train(core: ComputeCore, batches: list[np.ndarray]) -> list[float]:
    """Steps over whole global batches (every rank of a pipeline reads the same samples)."""
    return [core.step(lambda rows=b: rows, lr=core.cfg.train.lr)[0] for b in batches]


def save(core: ComputeCore, url: str, step: int) -> None:
    files = {"config.yaml": to_yaml(core.cfg), "tokenizer.json": ByteTokenizer().to_json()}
    mgr = CheckpointManager(url, keep=1)
    mgr.save(step, core.state(), {"step": step}, {}, files)
    mgr.close()


def resume(core: ComputeCore, url: str) -> int:
    state = core.state()
    mgr = CheckpointManager(url, keep=1)
    step = mgr.load(state)[0]
    core.after_load(state)
    mgr.close()
    return step


def _entry(rank: int, world: int, results: dict, root: str, batches: list[np.ndarray], split: int) -> None:
    core = core_for(["parallel.pp=2"], rank, world)
    train(core, batches[:split])
    save(core, f"{root}/pp2", split)
    # The other schedule holds other modules per rank (stages 0+2 and 1+3): the same names, resharded.
    core = core_for(["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], rank, world)
    results["resumed_step"] = resume(core, f"{root}/pp1")
    results["losses"] = train(core, batches[split:])


def pp2_round_trip(root: str, batches: list[np.ndarray], split: int) -> dict[int, Any]:
    """In 2 ranks at pp=2: train `split` steps (1f1b) and save root/pp2; resume root/pp1 (interleaved 1f1b) and
    train the rest."""
    results = gloo_ranks(_entry, 2, root, batches, split)
    errors = [r["error"] for r in results.values() if "error" in r]
    assert not errors, errors[0]
    return results
