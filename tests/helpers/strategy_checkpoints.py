"""Save real checkpoints of every strategy in 2 gloo processes (no Ray) and load them back on every rank."""

from __future__ import annotations

import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import load_config, to_yaml
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology
from cs3ray.models import ByteTokenizer

from helpers.core import MODEL, global_batches
from helpers.ranks import gloo_ranks

STRATEGIES = {"ddp": ["parallel.strategy=ddp"], "zero1": ["parallel.strategy=zero1"],
              "fsdp": ["parallel.strategy=fsdp"], "tp": ["parallel.tp=2"]}


def _entry(rank: int, world: int, results: dict, root: str) -> None:
    batch = global_batches(1, rows=4)[0]
    for name, overrides in STRATEGIES.items():
        cfg = load_config(None, MODEL + [f"cluster.workers={world}", "precision=fp32", *overrides])
        topo = Topology(rank, world, cfg.parallel.tp, ("n0",) * world)
        core = ComputeCore(cfg, torch.device("cpu"), topo)
        per = len(batch) // topo.dp
        core.step(lambda rows=batch[topo.dp_rank * per:(topo.dp_rank + 1) * per]: rows, lr=cfg.train.lr)  # optimizer state
        files = {"config.yaml": to_yaml(cfg), "tokenizer.json": ByteTokenizer().to_json()}
        mgr = CheckpointManager(f"{root}/{name}", keep=1)
        mgr.save(1, core.state(), {"step": 1}, {}, files)
        assert mgr.load(core.state())[0] == 1  # back through the restricted reader, on every rank
        mgr.close()


def save_and_load_every_strategy(root: str, world: int = 2) -> None:
    """A checkpoint of every strategy under root/<strategy>, each saved and loaded back by 2 ranks."""
    results = gloo_ranks(_entry, world, root)
    errors = [r["error"] for r in results.values() if "error" in r]
    assert not errors, errors[0]
