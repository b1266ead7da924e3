"""The peers of `cs3 bench train`: one hand-written PyTorch loop, in this process or in a Ray Train worker.

The loop is what a careful user writes without cs3ray: the same model, batch, autocast
precision, AdamW (foreach), gradient clipping and thread count, reading the same token
batches. `ray_train_peer` runs that very function inside a Ray Train `TorchTrainer` with one
worker, as a user of Ray Train would without cs3ray: no cs3ray worker, data stream,
checkpoints or monitor, so the difference to cs3ray's 1-worker run is what cs3ray adds.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cs3ray.config import JobConfig
from cs3ray.core.precision import autocast, resolve_precision
from cs3ray.models import Transformer


def plain_loop(cfg: JobConfig, batches: np.ndarray, threads: int, steps: int) -> list[float]:
    """Every step's seconds of a hand-written single-process loop (the peer). No Ray, no wrappers: the
    bench finds its steady state from them (cs3ray.bench.steady), by the rule every mode gets."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model.args())
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            foreach=True)
    device = torch.device("cpu")
    precision = resolve_precision(cfg.precision, device)
    b = t.batch_size
    step_s: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        x = torch.from_numpy(batches[(i * b) % (len(batches) - b):][:b])
        with autocast(precision, device):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the same host sync a loop that logs its loss does
        step_s.append(time.perf_counter() - t0)
    return step_s


def _train_fn(config: dict[str, Any]) -> list[float]:
    """Ray Train's train function: the plain loop; its step times are the run's return value."""
    return plain_loop(config["cfg"], config["batches"], config["threads"], config["steps"])


def ray_train_peer(cfg: JobConfig, batches: np.ndarray, threads: int, steps: int, storage: str) -> list[float]:
    """Every step's seconds of the plain loop in a 1-worker Ray Train TorchTrainer that reserves `threads` CPUs."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        _train_fn,
        train_loop_config={"cfg": cfg, "batches": batches, "threads": threads, "steps": steps},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": threads}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"plain-{time.time_ns()}", storage_path=storage),
    )
    return [float(x) for x in trainer.fit().return_value]
