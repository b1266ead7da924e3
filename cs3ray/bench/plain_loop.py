"""The peers of `cs3 bench train`: one hand-written PyTorch loop, in this process or in a Ray Train worker.

The loop is what a careful user writes without cs3ray: the same model, batch, autocast
precision, AdamW (foreach), gradient clipping and thread count, reading the same token
batches. `ray_train_peer` runs that very function inside a Ray Train `TorchTrainer` with one
worker, as a user of Ray Train would without cs3ray: no cs3ray worker, data stream,
checkpoints or monitor, so the difference to cs3ray's 1-worker run is what cs3ray adds.
On a CUDA device both run the loop on the GPU (the Ray Train worker on the one it reserved), fp16
with torch's GradScaler as that user would.
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


def plain_loop(cfg: JobConfig, batches: np.ndarray, threads: int, steps: int,
               device: torch.device | str = "cpu") -> list[float]:
    """Every step's seconds of a hand-written single-process loop (the peer) on `device`. No Ray, no
    wrappers: the bench finds its steady state from them (cs3ray.bench.steady), by the rule every mode gets."""
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    device = torch.device(device)
    model = Transformer(cfg.model.args()).to(device)  # built on the CPU as every mode builds it, then moved
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                            foreach=True)
    precision = resolve_precision(cfg.precision, device)
    # fp16 needs loss scaling (cs3ray scales too); disabled, the scaler passes everything through.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    b = t.batch_size
    step_s: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        x = torch.from_numpy(batches[(i * b) % (len(batches) - b):][:b]).to(device)
        with autocast(precision, device):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        # The same host sync a loop that logs its loss does; on a GPU it also waits for the step's kernels,
        # so the step's seconds are the device's.
        float(loss.detach())
        step_s.append(time.perf_counter() - t0)
    return step_s


def _train_fn(config: dict[str, Any]) -> list[float]:
    """Ray Train's train function: the plain loop; its step times are the run's return value."""
    from ray.train.torch import get_device

    # With use_gpu Ray Train gives the worker its GPU (CUDA_VISIBLE_DEVICES) and names it here.
    device = get_device() if config["device"] == "cuda" else torch.device("cpu")
    return plain_loop(config["cfg"], config["batches"], config["threads"], config["steps"], device)


def ray_train_scaling(threads: int, device: str):
    """The peer's ScalingConfig: 1 worker with `threads` CPUs, and on cuda one GPU (as cs3ray's workers reserve)."""
    from ray.train import ScalingConfig

    gpu = device == "cuda"
    return ScalingConfig(num_workers=1, use_gpu=gpu, resources_per_worker={"CPU": threads, **({"GPU": 1} if gpu else {})})


def ray_train_peer(cfg: JobConfig, batches: np.ndarray, threads: int, steps: int, storage: str,
                   device: str = "cpu") -> list[float]:
    """Every step's seconds of the plain loop in a 1-worker Ray Train TorchTrainer that reserves `threads` CPUs
    (and on `device` cuda one GPU, with nccl)."""
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        _train_fn,
        train_loop_config={"cfg": cfg, "batches": batches, "threads": threads, "steps": steps, "device": device},
        scaling_config=ray_train_scaling(threads, device),
        torch_config=TorchConfig(backend="nccl" if device == "cuda" else "gloo"),
        run_config=RunConfig(name=f"plain-{time.time_ns()}", storage_path=storage),
    )
    return [float(x) for x in trainer.fit().return_value]
