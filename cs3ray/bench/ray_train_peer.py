"""The peer of `cs3 bench recovery`: a plain Ray Train loop as its documentation teaches it.

TorchTrainer + FailureConfig, `prepare_model` (DDP), AdamW, a torch.save checkpoint reported
with `ray.train.report(..., checkpoint=...)` every K steps and `ray.train.get_checkpoint()` on
restart. Same model and batch as cs3ray's run; rank 0 appends one line per finished step
(and its pid set at start) to a local file, which is how the benchmark watches it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any


def train_fn(config: dict[str, Any]) -> None:
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from cs3ray.core.precision import autocast, resolve_precision
    from cs3ray.models import PRESETS, Transformer

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(Transformer(PRESETS[config["preset"]]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
    log = config["log"]
    pids: list[int] = [0] * ctx.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps({"event": "start", "step": start, "pids": pids, "wall": time.time()}) + "\n")
    rng = np.random.default_rng(rank + 1000 * start)
    for step in range(start + 1, config["steps"] + 1):
        if step > stop_after(config.get("stop_file")):
            break
        x = torch.from_numpy(rng.integers(0, 256, (config["batch"], config["seq"] + 1)))
        with autocast(resolve_precision("auto", "cpu"), torch.device("cpu")):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % config["every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    inner = model.module if hasattr(model, "module") else model
                    torch.save({"model": inner.state_dict(), "optim": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"event": "progress", "step": step, "workers": ctx.get_world_size(),
                                    "wall": time.time()}) + "\n")


def last_step(stop_file: str, step: int) -> None:
    """Tell a running peer to stop after `step` (written whole: a rank never reads half of it)."""
    with open(stop_file + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(stop_file + ".tmp", stop_file)


def stop_after(stop_file: str | None) -> float:
    """The last step the run may train: the stop file's, or no bound while there is none."""
    if not stop_file or not os.path.exists(stop_file):
        return float("inf")
    with open(stop_file) as f:
        return int(f.read())


def make_trainer(log: str, storage: str, steps: int, every: int, batch: int, seq: int, preset: str = "tiny",
                 max_failures: int = 2, stop_file: str | None = None):
    """The TorchTrainer of the peer run (2 workers, up to `max_failures` restarts; `stop_file`: see `last_step`)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        train_fn,
        train_loop_config={"log": log, "steps": steps, "every": every, "batch": batch, "seq": seq, "preset": preset,
                           "stop_file": stop_file},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=f"peer-{int(time.time())}", storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
