"""The per-worker training loop that Ray Train runs in every worker actor (one per rank)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cs3ray.ckpt import CheckpointManager
from cs3ray.ckpt.finetune import load_init_weights
from cs3ray.config import JobConfig, build_config, to_yaml
from cs3ray.config.redact import redact_value
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import discover
from cs3ray.core.mfu import mfu, stage_flops_per_token
from cs3ray.core.optim import lr_factor
from cs3ray.core.peak import measure_peak
from cs3ray.core.pipeline import rank_layers, virtual_stages
from cs3ray.core.precision import compute_dtype
from cs3ray.core.state import rng_state, set_rng_state
from cs3ray.data.dataset_stream import DatasetStream
from cs3ray.data.ray_stream import RayDataStream
from cs3ray.data.shards import read_manifest, read_split, shard_tokenizer
from cs3ray.data.stream import TrainStream
from cs3ray.models import load_tokenizer, train_flops_per_token
from cs3ray.ops.json_logs import process_logs, run_log, set_step
from cs3ray.storage import open_url

from .balance import Balancer
from .elastic import plan_batch
from .preemption import SIGTERM_RECEIVED, Preempted, wait_for_teardown
from .replicas import ReplicaSync, load_in_place
from .restarts import failure_event
from .snapshots import END, STEPS, SnapshotClock, trigger

# Step times a process keeps for its end event (`step_s`): enough to find a run's steady state.
STEP_TIMES_KEPT = 1024


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


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _worker_peak(dtype: torch.dtype, threads: int, device: str) -> float:
    """The matmul peak of one worker, measured by every rank at the same moment.

    A rank that measured while another was still starting up (importing, building its model)
    shared its cores and got a low peak, which inflated MFU past 1 (figures: docs/benchmarks.md).
    After a barrier every rank measures while the others do the same, each on the cores it
    reserved; the highest figure is used, so one disturbed rank cannot lower it.
    """
    if dist.is_initialized():
        dist.barrier()
    return max(_all_gather(measure_peak(dtype, threads, size=1024, seconds=0.5, device=device)))


class Worker:
    """One rank: builds the compute core, restores state, and runs steps, evals and checkpoints."""

    def __init__(self, cfg: JobConfig, run_url: str, shards_url: str | None, monitor: Any,
                 val_rows: np.ndarray | None = None) -> None:
        import ray
        import ray.train
        import ray.train.torch

        self.cfg, self.monitor = cfg, monitor
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.replicated = cfg.cluster.fault_tolerance == "replicas"
        # Who reports events: rank 0, or with fault-tolerant replicas the first one alive this step.
        self.reporter = self.rank == 0
        self.threads = max(1, int(cfg.cluster.cpus_per_worker))
        # Ray sets OMP_NUM_THREADS=1 in workers; use exactly the CPUs this worker reserved.
        torch.set_num_threads(self.threads)
        self.device = ray.train.torch.get_device()
        self.topo = discover(cfg.parallel.tp, ray.get_runtime_context().get_node_id(), cfg.parallel.pp)
        self.core = ComputeCore(cfg, self.device, self.topo)
        if cfg.train.init_from:
            # Any strategy / world size: DCP reshards the pretrained weights into this layout.
            # A resumed run overwrites them with its own checkpoint below.
            load_init_weights(self.core.model, cfg.train.init_from, cfg.storage.options)
        # Every rank builds it at the same point: async mode creates its own gloo group here.
        self.ckpt = CheckpointManager.from_config(run_url, cfg)
        self.progress = Progress()
        self.stream: TrainStream | DatasetStream | None = None
        self._comm_sent = 0  # gradient bytes sent as of the last progress report
        # Keep the global batch whatever the number of workers (elastic resizes, retries).
        self.plan = plan_batch(cfg, self.topo.dp)
        self.core.grad_accum = self.plan.grad_accum
        # The run directory only holds this run's checkpoints (the driver refuses or clears
        # others), so one present means --resume, or Ray Train restarting a failed group.
        restored_rng = self._restore() if self.ckpt.latest() is not None else False
        self.sync: ReplicaSync | None = None
        if self.replicated:
            self.sync = ReplicaSync(self.rank, self._live_state, self._heal, self.progress.step)
            self.core.sync_grads, self.core.may_commit = self.sync.sync_grads, self.sync.commit
            if monitor is not None:  # every replica's process, for fault injection and operators
                monitor.record.remote({"event": "worker", "wall": time.time(), "rank": self.rank, "pid": os.getpid()})
        # A restore with this rank's saved generators continues their streams (dropout and
        # sampling as in an uninterrupted run); a fresh start or a resized group seeds them.
        if not restored_rng:
            torch.manual_seed(cfg.train.seed + 1000 * self.rank + self.progress.step)
        self.shards_url = shards_url
        if shards_url is None:  # a user's Ray Dataset: the driver took the validation rows from it
            self.val = self._val_batches(val_rows)
            self.tokenizer_json = load_tokenizer(cfg.data.tokenizer).to_json()
        else:
            shards = open_url(shards_url, cfg.storage.options)
            self.val = self._val_batches(read_split(shards, read_manifest(shards), "val"))
            # Checkpoints carry the tokenizer the shards were made with (on every node, unlike a local file).
            self.tokenizer_json = shard_tokenizer(read_manifest(shards), shards.url).to_json()
        self.flops_per_token = (6.0 * self.core.n_params if cfg.model.target
                                else train_flops_per_token(cfg.model.args(), cfg.train.seq_len))
        if cfg.parallel.pp > 1:  # what this rank's pipeline stages compute of it
            args, rank, pp = cfg.model.args(), self.topo.pp_rank, self.topo.pp
            layers = rank_layers(args.n_layers, rank, pp, virtual_stages(cfg.parallel.pp_schedule))
            self.stage_flops = stage_flops_per_token(args, cfg.train.seq_len, layers, rank == pp - 1)
        # MFU is against the peak of this worker's own device and thread count, measured here.
        self.peak_flops = _worker_peak(compute_dtype(self.core.precision), self.threads, self.device.type)

    def _val_batches(self, val: np.ndarray) -> list[np.ndarray]:
        """This data-parallel rank's share of the fixed validation batches (the same every eval).

        Every rank gets the same number of batches: FSDP and TP forwards are collectives, so
        an uneven split would leave one rank waiting forever for the others.
        """
        b, dp = self.cfg.train.batch_size, self.topo.dp
        per_rank = max(1, self.cfg.train.eval_batches // dp)
        rows = np.arange(b * per_rank * dp) % len(val)  # wrap around a validation split smaller than asked
        mine = rows.reshape(dp, per_rank, b)[self.topo.dp_rank]
        return [val[idx] for idx in mine]

    def _restore(self) -> bool:
        """Load the newest checkpoint; True when this rank's own RNG streams were restored too."""
        t0 = time.perf_counter()
        state = self.core.state()
        step, meta, rank_state = self.ckpt.load(state)
        self.core.after_load(state)
        self.progress = Progress(step=step, tokens_seen=meta["tokens_seen"],
                                 initial_val_loss=meta.get("initial_val_loss"), val_loss=meta.get("val_loss"),
                                 data_position=meta.get("data"))
        self.core.scaler.load_state_dict(meta["scaler"])
        if rank_state is not None:
            set_rng_state(rank_state)
        self.core.load_compression_state((rank_state or {}).get("compression"), step)
        source = self.ckpt.last_restore.source if self.ckpt.last_restore else "storage"
        self._event("restored", step=step, from_world_size=meta.get("world_size"),
                    from_strategy=meta.get("strategy"), from_pp=meta.get("pp", 1), restored_from=source,
                    data_samples=(meta.get("data") or {}).get("samples"),
                    seconds=round(time.perf_counter() - t0, 3))
        return rank_state is not None

    def _live_state(self) -> dict[str, Any]:
        """What a survivor sends a replica that heals from it: everything a checkpoint would hold."""
        p = self.progress
        return {"core": self.core.state(), "scaler": self.core.scaler.state_dict(),
                "progress": {"step": p.step, "tokens_seen": p.tokens_seen, "initial_val_loss": p.initial_val_loss,
                             "val_loss": p.val_loss},
                "samples": self.stream.position if self.stream is not None else None}

    def _heal(self, live: dict[str, Any]) -> None:
        state = self.core.state()
        load_in_place(state["optim"], live["core"]["optim"])
        state["model"] = live["core"]["model"]
        self.core.after_load(state)
        self.core.scaler.load_state_dict(live["scaler"])
        self.progress.step, self.progress.tokens_seen = live["progress"]["step"], live["progress"]["tokens_seen"]
        self.progress.initial_val_loss, self.progress.val_loss = (live["progress"]["initial_val_loss"],
                                                                  live["progress"]["val_loss"])
        if self.stream is not None and live["samples"] is not None:
            self.stream.seek(live["samples"])
        if self.monitor is not None:
            self.monitor.record.remote({"event": "healed", "wall": time.time(), "rank": self.rank,
                                        "step": self.progress.step})

    def _event(self, kind: str, **data: Any) -> None:
        if self.reporter and self.monitor is not None:
            # `wall`: when it happened on the worker (the log's `time` is when the driver saw it).
            self.monitor.record.remote({"event": kind, "wall": time.time(), **data})

    def evaluate(self) -> float:
        total, count = self.core.evaluate(self.val)
        # Only one rank per tensor-parallel group counts, or its loss would be summed tp times.
        if self.topo.tp_rank:
            total, count = 0.0, 0
        total, count = _all_reduce([total, count], self.device)
        return total / max(count, 1)

    def save(self, why: str = STEPS) -> str:
        """Snapshot the run at this step on every rank; `why` (a snapshots trigger) goes into its event."""
        p = self.progress
        meta = {"step": p.step, "tokens_seen": p.tokens_seen, "initial_val_loss": p.initial_val_loss,
                "val_loss": p.val_loss, "scaler": self.core.scaler.state_dict(), "world_size": self.world,
                "data": self.stream.state() if self.stream is not None else p.data_position,
                "strategy": self.cfg.parallel.strategy, "tp": self.cfg.parallel.tp, "pp": self.cfg.parallel.pp,
                "precision": self.core.precision}
        files = {"config.yaml": to_yaml(self.cfg), "tokenizer.json": self.tokenizer_json}
        t0 = time.perf_counter()
        # Error-feedback residuals travel in this rank's own file, beside its RNG streams.
        compression = self.core.compression_state()
        rank_state = {**rng_state(), **({"compression": compression} if compression else {})}
        url = self.ckpt.save(p.step, self.core.state(), meta, rank_state, files)
        self._event("checkpoint", step=p.step, url=url, seconds=round(time.perf_counter() - t0, 3), trigger=why,
                    data_samples=meta["data"]["samples"] if meta["data"] else None)
        run_log.info("checkpoint of step %d (%s) staged in %.3f s: %s", p.step, why, time.perf_counter() - t0,
                     redact_value(url))
        return url

    def run(self) -> None:
        import ray.train

        cfg, t, p = self.cfg, self.cfg.train, self.progress
        tokens_per_step = self.plan.global_samples * t.seq_len
        set_step(p.step)
        run_log.info("rank %d of %d starts at step %d (micro-batch %d, grad_accum %d, %s)", self.rank, self.world,
                     p.step, self.plan.micro_batch, self.plan.grad_accum, self.core.precision)
        self._event("start", step=p.step, workers=self.world, params=self.core.n_params, total_steps=t.steps,
                    nodes=len(set(self.topo.node_ids)), node_ids=list(self.topo.node_ids), tp=self.topo.tp, strategy=cfg.parallel.strategy,
                    peak_flops=self.peak_flops, threads=self.threads, precision=self.core.precision, pids=_all_gather(os.getpid()),
                    # Each rank's training thread's niceness: Ray starts workers at nice 15 (docs/operations.md).
                    nice=_all_gather(os.getpriority(os.PRIO_PROCESS, 0)),
                    micro_batch=self.plan.micro_batch, grad_accum=self.plan.grad_accum, **self._pipeline_info())
        if p.initial_val_loss is None:
            p.initial_val_loss = p.val_loss = self.evaluate()
            self._event("eval", step=p.step, val_loss=p.val_loss)
        # Streams are keyed by data-parallel rank: the ranks of one tensor-parallel group read
        # the same samples, and the global order only depends on the data-parallel width.
        self.stream = self._open_stream()
        next_batch = lambda: next(self.stream)  # noqa: E731
        last_ckpt = p.step if p.step > 0 else None
        window_t, window_steps, stopped = time.perf_counter(), 0, False
        # This log window's step times and skipped steps: the driver's step-time histogram and counters.
        window_step_s: list[float] = []
        window_skipped_from = self.core.scaler.skipped
        first_step = p.step
        step_s: list[float] = []  # this process's first STEP_TIMES_KEPT steps: where a run reaches its steady state
        tracked = False  # this log window holds the step measured for peak memory
        participants = self.world
        balancer = Balancer([self.plan.micro_batch] * self.topo.dp) if t.balance and self.topo.dp > 1 else None
        self._balance_mark = (time.perf_counter(), self.core.busy.seconds, p.step)
        snapshots = SnapshotClock(cfg.checkpoint.every_minutes)
        sigterm_told = False
        while p.step < t.steps:
            t0 = time.perf_counter()
            if self.sync is not None:
                participants, start = self._join_step()
                if p.step >= t.steps:  # healed from a replica that has finished
                    break
            lr = t.lr * lr_factor(p.step, t.warmup_steps, t.steps, t.min_lr_ratio)
            # The second step is measured for peak memory (the first one allocates optimizer state lazily).
            track = p.step == first_step + 1
            tracked = tracked or track
            loss, ok = self.core.step(next_batch, lr, track_memory=track)
            stop_flag, drain_s = self._control() if self.reporter else (False, None)
            stop_flag = 1.0 if stop_flag else 0.0
            # The reporter's vote for a checkpoint.every_minutes snapshot rides on this step's all-reduce,
            # so every rank snapshots at the same step without a collective of its own (train/snapshots.py).
            due_flag = 1.0 if self.reporter and snapshots.due() else 0.0
            if self.sync is not None:
                if self.sync.manager.current_step() == p.step:  # a replica failed mid-step: redo it
                    self.stream.seek(start)
                    continue
                loss_sum, stop, due = (v * participants for v in self.sync.average([loss, stop_flag, due_flag]))
                drained = terminated = 0.0  # replicas ride out a lost node or process: no preemption snapshot
            else:
                # Preemption votes ride along too (train/preemption.py): the reporter's drain notice, with the
                # seconds left before its deadline, and any rank's SIGTERM.
                drain_flag = 0.0 if drain_s is None else 1.0
                term_flag = 1.0 if SIGTERM_RECEIVED.is_set() else 0.0
                # Weighted by the rows each rank took (train.balance; 1 on every rank otherwise).
                loss_sum, stop, due, drained, drain_left, terminated = _all_reduce(
                    [loss * self.core.sample_weight, stop_flag, due_flag, drain_flag, drain_s or 0.0, term_flag],
                    self.device)
                if term_flag and not sigterm_told:
                    sigterm_told = self._tell_sigterm(p.step + 1)
            preempted = drained >= 0.5 or terminated >= 0.5
            p.step += 1
            set_step(p.step)
            # One rank per tensor-parallel group traces: its ranks read the same samples.
            self.stream.trace_step(p.step, write=self.topo.tp_rank == 0 and self.topo.pp_rank == 0)
            p.tokens_seen += tokens_per_step
            window_steps += 1
            step_time = time.perf_counter() - t0
            if len(step_s) < STEP_TIMES_KEPT:
                step_s.append(round(step_time, 6))
            window_step_s.append(round(step_time, 6))
            if p.step % t.log_every == 0 or p.step == t.steps or stop:
                elapsed = time.perf_counter() - window_t
                tps = tokens_per_step * window_steps / elapsed
                self._event("progress", step=p.step, loss=loss_sum / participants, step_time_s=step_time,
                            **self._comm_window(window_steps),
                            tokens_per_s=tps, tokens_seen=p.tokens_seen, skipped_steps=self.core.scaler.skipped,
                            window_tokens=tokens_per_step * window_steps, step_times_s=window_step_s,
                            window_skipped=self.core.scaler.skipped - window_skipped_from,
                            mfu=mfu(tps, self.flops_per_token, self.world, self.peak_flops), lr=lr, step_applied=ok,
                            grad_norm=self.core.grad_norm,
                            loss_scale=self.core.scaler.scale, workers=participants, memory_tracked=tracked,
                            cache=self.stream.cache_counters(), **self._bubble())
                run_log.info("step %d loss %.4f step_time_s %.3f tokens_per_s %.0f", p.step, loss_sum / participants,
                             step_time, tps)
                window_t, window_steps, tracked = time.perf_counter(), 0, False
                window_step_s, window_skipped_from = [], self.core.scaler.skipped
            if balancer is not None and p.step % t.balance_every == 0:
                self._rebalance(balancer)
            if p.step % t.eval_every == 0 or p.step == t.steps or stop:
                p.val_loss = self.evaluate()
                self._event("eval", step=p.step, val_loss=p.val_loss)
            why = trigger(p.step, cfg.checkpoint.every, t.steps, timed=due >= 0.5, stop=bool(stop), preempted=preempted)
            if why is not None:
                if self.sync is None or self.reporter:  # replicas are identical: one of them writes
                    self.save(why)
                snapshots.taken()
                last_ckpt = p.step
            if stop:
                stopped = True
                break
            if preempted and p.step < t.steps:
                self._end_preempted(drained >= 0.5, drain_left)
        if last_ckpt != p.step and (self.sync is None or self.reporter):
            self.save(END)
        self.ckpt.close()  # an async final snapshot is on storage before the workers exit
        if self.sync is not None:
            self.sync.shutdown()
        self.stream.close()
        memory = _all_gather(self.core.memory())
        comm = _all_gather(self.core.comm_stats())  # None on every rank unless gradients are compressed
        final = {"step": p.step, "val_loss": p.val_loss, "initial_val_loss": p.initial_val_loss,
                 "tokens_seen": p.tokens_seen, "stopped": stopped, "skipped_steps": self.core.scaler.skipped}
        self._event("end", memory=memory, comm=comm, step_s=step_s, **final)
        run_log.info("rank %d ends at step %d%s", self.rank, p.step, " (stopped)" if stopped else "")
        if self.sync is None:  # a report is a barrier of all workers, which replicas must never wait on
            ray.train.report({k: v for k, v in final.items() if isinstance(v, (int, float)) and not math.isnan(v)})

    def _rebalance(self, balancer: Balancer) -> None:
        """End of a balance window: every rank's compute seconds and rows; re-split when the balancer says so."""
        wall0, busy0, step0 = self._balance_mark
        wall, busy = time.perf_counter() - wall0, self.core.busy.seconds - busy0
        steps = self.progress.step - step0
        self._balance_mark = (time.perf_counter(), self.core.busy.seconds, self.progress.step)
        shares = balancer.shares
        rows = shares[self.topo.dp_rank] * self.plan.grad_accum * steps
        # One entry per data-parallel rank: the ranks of a tensor-parallel group take the same rows.
        seen = sorted((r, b, n) for r, t, b, n in _all_gather((self.topo.dp_rank, self.topo.tp_rank, busy, rows))
                      if t == 0)
        busy_s, rows_seen = [b for _, b, _ in seen], [n for _, _, n in seen]
        new = balancer.observe(busy_s, rows_seen)
        self._event("balance", step=self.progress.step, shares=list(shares), busy_s=[round(b, 4) for b in busy_s],
                    window_s=round(wall, 4), utilization=[round(b / wall, 4) for b in busy_s] if wall > 0 else None,
                    rebalanced=new)
        if new is not None:
            self.stream.reshare(new)
            self.core.sample_weight = len(new) * new[self.topo.dp_rank] / sum(new)

    def _open_stream(self) -> TrainStream | DatasetStream:
        """This rank's micro-batches, through the loader data.loader names (the same samples either way)."""
        cfg, p = self.cfg, self.progress
        if self.shards_url is None:
            import ray.train

            return DatasetStream(ray.train.get_dataset_shard("train"), self.plan.micro_batch, cfg.train.seq_len + 1,
                                 cfg.model.args().vocab_size, p.data_position, world=self.topo.dp)
        # The run names the cache's node counters on Prometheus (data/cache/node_metrics.py).
        args = dict(shards_url=self.shards_url, storage_options=cfg.storage.options,
                    cache={**cfg.cache.model_dump(), "run": cfg.run.name},
                    rank=self.topo.dp_rank, world=self.topo.dp, transform=cfg.data.transform)
        if cfg.data.loader == "ray_data":
            # Planned up to the last step; a redone step or a re-split continues in a new pipeline.
            horizon = max(1, (cfg.train.steps - p.step) * self.plan.grad_accum)
            return RayDataStream(self.plan.micro_batch, cfg.train.seed, p.data_position, horizon=horizon,
                                 cpus=cfg.data.loader_cpus, **args)
        return TrainStream(self.plan.micro_batch, cfg.train.seed, p.data_position, **args)

    def _pipeline_info(self) -> dict[str, Any]:
        """Pipeline runs: the degree, schedule and each rank's stage FLOPs per token (they add up to the model's
        per pipeline, so MFU over all workers counts each stage's work once)."""
        if self.topo.pp == 1:
            return {}
        pp = self.cfg.parallel
        return {"pp": pp.pp, "pp_schedule": pp.pp_schedule, "pp_microbatches": pp.pp_microbatches,
                "stage_flops_per_token": _all_gather(self.stage_flops)}

    def _bubble(self) -> dict[str, Any]:
        """Pipeline runs: the idle share of the first stage's time since the last report, and where each
        stage's time went (computing, sends and receives, the rest)."""
        window = self.core.pipeline_window()
        return {} if window is None else {**window, "bubble_fraction": round(window["bubble_fraction"], 4)}

    def _comm_window(self, steps: int) -> dict[str, Any]:
        """Compressed runs: gradient bytes this rank sent per step since the last report, and the wire ratio."""
        stats = self.core.comm_stats()
        if not stats or not steps:
            return {}
        sent = stats["bytes_sent"]
        per_step, self._comm_sent = (sent - self._comm_sent) / steps, sent
        return {"comm_bytes_per_step": round(per_step), "wire_ratio": stats["wire_ratio"]}

    def _join_step(self) -> tuple[int, int]:
        """Replicas: join this step's quorum and take its share of the global batch.

        Returns the number of participants and the global sample offset the step starts at.
        """
        step, rank, n = self.sync.begin_step()  # a replica that is behind heals here (see _heal)
        self.progress.step = step
        self.reporter = rank == 0
        plan = plan_batch(self.cfg, n)
        self.core.grad_accum = plan.grad_accum
        start = self.stream.position
        self.stream.seek(start, rank, n, plan.micro_batch)
        return n, start

    def _control(self) -> tuple[bool, float | None]:
        """The monitor's answer (one call, by the reporter only): stop?, and seconds left before a drain's deadline
        (0: a drain without one) or None."""
        import ray

        return (False, None) if self.monitor is None else ray.get(self.monitor.control.remote())

    def _tell_sigterm(self, step: int) -> bool:
        """This rank got SIGTERM: the monitor hears it from this rank (any rank may be the one), once."""
        if self.monitor is not None:
            self.monitor.record.remote({"event": "preemption", "wall": time.time(), "notice": "sigterm",
                                        "rank": self.rank, "step": step})
        return True

    def _end_preempted(self, drained: bool, drain_left: float) -> None:
        """The snapshot of this step is taken: make it durable, then end this attempt without training on.

        A drain: Ray Train ends the group at the deadline (or when the drained node is lost) and restarts it on
        the remaining nodes; until then this rank waits. A SIGTERM: the group ends now."""
        self.ckpt.wait()  # an async snapshot is committed before anything ends
        step = self.progress.step
        if drained:
            now = time.time()
            wait_for_teardown(now + drain_left if drain_left > 0 else None, now, step)
        raise Preempted(f"a worker received SIGTERM; the snapshot of step {step} is taken")


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: `config` carries the job, the run URL and the monitor handle."""
    import ray.train

    cfg = build_config(config["job"])
    worker: Worker | None = None
    with process_logs(cfg.run.log_format, "worker", cfg.run.name, rank=ray.train.get_context().get_world_rank()):
        try:
            worker = Worker(cfg, config["run_url"], config["shards_url"], config.get("monitor"), config.get("val_rows"))
            worker.run()
        except BaseException as exc:
            run_log.error("worker failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, KeyboardInterrupt))
            _report_failure(config.get("monitor"), worker, exc)
            raise


def _report_failure(monitor: Any, worker: "Worker | None", exc: BaseException) -> None:
    """Tell the run's monitor why this worker fails (the restart's cause), waiting briefly: the process may end."""
    import ray

    if monitor is None:
        return
    try:
        rank = ray.train.get_context().get_world_rank()
        step = worker.progress.step if worker is not None else None
        ray.get(monitor.record.remote(failure_event(rank, step, exc)), timeout=5)
    except Exception:  # noqa: BLE001 - the failure itself is what Ray Train reports; this is only its cause
        pass
