"""The per-worker training loop that Ray Train runs in every worker actor (one per rank)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import JobConfig, build_config, to_yaml
from cs3ray.core.optim import build_optimizer, lr_factor, set_lr
from cs3ray.core.parallel import apply_ddp
from cs3ray.core.precision import LossScaler, autocast
from cs3ray.data.shards import read_manifest, read_split
from cs3ray.data.stream import TrainStream
from cs3ray.models import ByteTokenizer, train_flops_per_token
from cs3ray.models.factory import count_parameters, model_from_config
from cs3ray.storage import open_url

from . import state as ckpt_state


@dataclass
class Progress:
    """Run state that a checkpoint carries besides tensors."""

    step: int = 0
    tokens_seen: int = 0
    initial_val_loss: float | None = None
    val_loss: float | None = None
    data_position: dict[str, Any] | None = None


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


class Worker:
    """One rank: builds the model, restores state, and runs steps, evals and checkpoints."""

    def __init__(self, cfg: JobConfig, run_url: str, shards_url: str, resume: bool, monitor: Any) -> None:
        import ray.train
        import ray.train.torch

        self.cfg, self.monitor = cfg, monitor
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        # Ray sets OMP_NUM_THREADS=1 in workers; use exactly the CPUs this worker reserved.
        torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
        self.device = ray.train.torch.get_device()
        torch.manual_seed(cfg.train.seed)  # identical init on every rank
        model = model_from_config(cfg).to(self.device)
        self.n_params = count_parameters(model)
        self.model = apply_ddp(model, self.device)
        t = cfg.train
        self.optimizer = build_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        self.scaler = LossScaler(cfg.precision == "fp16")
        self.ckpt = CheckpointManager(run_url, cfg.storage.options, cfg.checkpoint.keep)
        self.progress = Progress()
        self.stream: TrainStream | None = None
        if resume and self.ckpt.latest() is not None:
            self._restore()
        torch.manual_seed(cfg.train.seed + 1000 * self.rank + self.progress.step)
        self.val = self._val_slice(shards_url)
        self.flops_per_token = self._flops_per_token()

    def _flops_per_token(self) -> float:
        if self.cfg.model.target:
            return 6.0 * self.n_params  # a user's model: the 6N rule without the attention term
        return train_flops_per_token(self.cfg.model.args(), self.cfg.train.seq_len)

    def _val_slice(self, shards_url: str) -> list[np.ndarray]:
        """This rank's share of the fixed validation batches (the same every eval)."""
        shards = open_url(shards_url, self.cfg.storage.options)
        val = read_split(shards, read_manifest(shards), "val")
        b = self.cfg.train.batch_size
        n = min(len(val), b * self.cfg.train.eval_batches)
        batches = [val[i:i + b] for i in range(0, n, b)]
        return batches[self.rank::self.world]

    def _restore(self) -> None:
        state = ckpt_state.capture(self.model, self.optimizer)
        step, meta, rank_state = self.ckpt.load(state)
        ckpt_state.restore(self.model, self.optimizer, state)
        self.progress = Progress(step=step, tokens_seen=meta["tokens_seen"],
                                 initial_val_loss=meta.get("initial_val_loss"), val_loss=meta.get("val_loss"),
                                 data_position=meta.get("data"))
        self.scaler.load_state_dict(meta["scaler"])
        if rank_state is not None:
            ckpt_state.set_rng_state(rank_state)
        self._event("restored", step=step)

    def _event(self, kind: str, **data: Any) -> None:
        if self.rank == 0 and self.monitor is not None:
            self.monitor.record.remote({"event": kind, **data})

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, count = 0.0, 0
        for batch in self.val:
            x = torch.from_numpy(batch).to(self.device)
            with autocast(self.cfg.precision, self.device):
                logits = self.model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            total += float(loss)
            count += x[:, 1:].numel()
        self.model.train()
        total, count = _all_reduce([total, count], self.device)
        return total / max(count, 1)

    def train_step(self, batches) -> tuple[float, bool]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, step applied)."""
        t = self.cfg.train
        set_lr(self.optimizer, t.lr * lr_factor(self.progress.step, t.warmup_steps, t.steps, t.min_lr_ratio))
        total = 0.0
        for micro in range(t.grad_accum):
            x = torch.from_numpy(next(batches)).to(self.device)
            last = micro == t.grad_accum - 1
            # Skip the gradient all-reduce on all but the last micro-batch.
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with autocast(self.cfg.precision, self.device):
                    logits = self.model(x[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()) / t.grad_accum
                self.scaler.scale_loss(loss).backward()
            total += float(loss)
        params = [p for p in self.model.parameters() if p.requires_grad]
        ok = self.scaler.unscale_and_check(params)
        if ok:
            if t.clip > 0:
                torch.nn.utils.clip_grad_norm_(params, t.clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, ok

    def save(self) -> str:
        p = self.progress
        meta = {"step": p.step, "tokens_seen": p.tokens_seen, "initial_val_loss": p.initial_val_loss,
                "val_loss": p.val_loss, "scaler": self.scaler.state_dict(), "world_size": self.world,
                "data": self.stream.state() if self.stream is not None else p.data_position,
                "strategy": self.cfg.parallel.strategy, "precision": self.cfg.precision}
        files = {"config.yaml": to_yaml(self.cfg), "tokenizer.json": ByteTokenizer().to_json()}
        t0 = time.perf_counter()
        url = self.ckpt.save(p.step, ckpt_state.capture(self.model, self.optimizer), meta,
                             ckpt_state.rng_state(), files)
        self._event("checkpoint", step=p.step, url=url, seconds=round(time.perf_counter() - t0, 3))
        return url

    def run(self) -> None:
        import ray.train

        cfg, t, p = self.cfg, self.cfg.train, self.progress
        tokens_per_step = self.world * t.batch_size * t.grad_accum * t.seq_len
        self._event("start", step=p.step, workers=self.world, params=self.n_params, total_steps=t.steps)
        if p.initial_val_loss is None:
            p.initial_val_loss = p.val_loss = self.evaluate()
            self._event("eval", step=p.step, val_loss=p.val_loss)
        self.stream = TrainStream(t.batch_size, t.seed, p.data_position)
        batches = self.stream
        last_ckpt = p.step if p.step > 0 else None
        window_t, window_steps, stopped = time.perf_counter(), 0, False
        while p.step < t.steps:
            t0 = time.perf_counter()
            loss, ok = self.train_step(batches)
            p.step += 1
            p.tokens_seen += tokens_per_step
            window_steps += 1
            stop_flag = 1.0 if self.rank == 0 and self._stop_requested() else 0.0
            loss_sum, stop = _all_reduce([loss, stop_flag], self.device)
            step_time = time.perf_counter() - t0
            if p.step % t.log_every == 0 or p.step == t.steps or stop:
                elapsed = time.perf_counter() - window_t
                tps = tokens_per_step * window_steps / elapsed
                self._event("progress", step=p.step, loss=loss_sum / self.world, step_time_s=step_time,
                            tokens_per_s=tps, tokens_seen=p.tokens_seen, skipped_steps=self.scaler.skipped,
                            flops_per_s=tps * self.flops_per_token,
                            lr=self.optimizer.param_groups[0]["lr"], step_applied=ok)
                window_t, window_steps = time.perf_counter(), 0
            if p.step % t.eval_every == 0 or p.step == t.steps or stop:
                p.val_loss = self.evaluate()
                self._event("eval", step=p.step, val_loss=p.val_loss)
            if p.step % cfg.checkpoint.every == 0 or p.step == t.steps or stop:
                self.save()
                last_ckpt = p.step
            if stop:
                stopped = True
                break
        if last_ckpt != p.step:
            self.save()
        final = {"step": p.step, "val_loss": p.val_loss, "initial_val_loss": p.initial_val_loss,
                 "tokens_seen": p.tokens_seen, "stopped": stopped}
        self._event("end", **final)
        ray.train.report({k: v for k, v in final.items() if isinstance(v, (int, float)) and not math.isnan(v)})

    def _stop_requested(self) -> bool:
        import ray

        return self.monitor is not None and ray.get(self.monitor.should_stop.remote())


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: `config` carries the job, the run URL and the monitor handle."""
    cfg = build_config(config["job"])
    worker = Worker(cfg, config["run_url"], config["shards_url"], config["resume"], config.get("monitor"))
    worker.run()
