"""The driver side of a training run: prepare data, start Ray Train, follow progress, summarise."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from cs3ray.ckpt import list_steps, resolve_checkpoint, step_dir
from cs3ray.config import JobConfig, to_yaml
from cs3ray.config.redact import redact_values
from cs3ray.data import ShardSpec, ensure_shards, prepared_shards
from cs3ray.data.dataset_stream import RESTART_WARNING, check_rows
from cs3ray.data.transform import load_transform
from cs3ray.errors import UserError
from cs3ray.models import check_same, load_tokenizer, tokenizer_from_json
from cs3ray.ops.cluster import default_num_cpus, ray_cluster
from cs3ray.ops.events import EventLog
from cs3ray.ops.json_logs import event_message, process_logs, run_log
from cs3ray.ops.metrics import RunMetrics
from cs3ray.ops.run_loggers import RunLogger, check_loggers, close_loggers, observe_all, open_loggers
from cs3ray.storage import Storage, StorageError, open_url

from .placement import check_placement, scaling_config

log = logging.getLogger(__name__)
EventSink = Callable[[dict[str, Any]], None]


class TrainingError(RuntimeError):
    """The workers failed (not the user's input): carries the worker's own error message."""


POLL_S = 1.0  # seconds between the driver's reads of the workers' progress events


def _run_has_content(run: Storage) -> bool:
    return bool(run.exists() and (run.ls() and (run.exists("config.yaml") or list_steps(run))))


def prepare_run_dir(cfg: JobConfig, resume: bool, overwrite: bool) -> Storage:
    """Check --resume/--overwrite against what the run directory holds, and clear it if asked."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other; pick one.")
    run = open_url(cfg.run.path(), cfg.storage.options)
    taken = _run_has_content(run)
    if taken and not (resume or overwrite):
        raise UserError(f"run '{cfg.run.name}' already exists at '{run.url}': pass --resume to continue it "
                        f"or --overwrite to start it over (or choose another --name).")
    if resume and not taken:
        raise UserError(f"nothing to resume: run '{cfg.run.name}' has no checkpoint at '{run.url}'.")
    if overwrite and run.exists():
        run.rm()
    run.makedirs()
    return run


def prepare_data(cfg: JobConfig, on_event: EventSink | None = None) -> tuple[Storage, dict]:
    """The job's shards: the prepared shard set data.source names, verified (never prepared again), or the
    corpus' shards from the cache or made now (`prepare_corpus`)."""
    return named_shard_set(cfg) or prepare_corpus(cfg, on_event)


def named_shard_set(cfg: JobConfig) -> tuple[Storage, dict] | None:
    """The shard set data.source names, verified for this job before any worker starts (manifest, tokenizer,
    seq_len, listing: cs3ray.data.shard_source); None when data.source is a corpus."""
    return prepared_shards(cfg.data.source, cfg.storage.options, load_tokenizer(cfg.data.tokenizer),
                           cfg.train.seq_len)


def prepare_corpus(cfg: JobConfig, on_event: EventSink | None = None) -> tuple[Storage, dict]:
    """Shards for the job's corpus, from the cache or made now (reported as 'prepare' events): by the Ray
    Data pipeline when Ray is connected, as in `train`; in this process otherwise, with the same output."""
    import ray

    d = cfg.data
    spec = ShardSpec(cfg.train.seq_len, d.samples_per_shard, d.val_fraction, d.max_bytes, d.seed)
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        if on_event:
            on_event({"event": "prepare", "bytes": done[0], "total": d.max_bytes})

    return ensure_shards(d.source, d.cache_dir, spec, d.format, d.text_column, cfg.storage.options, progress,
                         tokenizer=load_tokenizer(d.tokenizer), distributed=ray.is_initialized())


def check_tokenizer(cfg: JobConfig, run: Storage, resume: bool) -> None:
    """Refuse a data.tokenizer other than the one of the checkpoint resumed or of train.init_from's weights."""
    tok = load_tokenizer(cfg.data.tokenizer)
    folders = []
    steps = list_steps(run) if resume else []
    if steps:
        folders.append(run.child(step_dir(steps[-1])))
    if cfg.train.init_from:
        try:
            folders.append(resolve_checkpoint(cfg.train.init_from, cfg.storage.options))
        except UserError:
            pass  # the worker reports a missing or damaged init_from checkpoint as it loads it
    for folder in folders:
        try:
            text = folder.read_text("tokenizer.json")
        except (OSError, StorageError, UnicodeDecodeError):
            continue  # an unreadable checkpoint is refused, with its reason, by the verified load
        check_same(tokenizer_from_json(text, f"'{folder.url}/tokenizer.json'"), tok, f"checkpoint '{folder.url}'")


def _check_transform(spec: str | None) -> None:
    """Import data.transform here first: one clear error now, not a failed task on every worker. Ray's workers
    import from the driver's working directory, so this check does too (a console script's path lacks it)."""
    if spec and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    load_transform(spec)


def _check_dataset_config(cfg: JobConfig, resume: bool) -> None:
    """What a run fed by the user's Ray Dataset cannot do, refused before anything starts."""
    if cfg.cluster.fault_tolerance == "replicas":
        raise UserError("cluster.fault_tolerance=replicas re-splits every step's samples by the global order, "
                        "which a Ray Dataset has not: train on a shard set (data.source) or use fault_tolerance=none.")
    if cfg.data.loader != "direct" or cfg.data.transform:
        raise UserError("data.loader and data.transform apply to shard sets; with your own Ray Dataset, "
                        "transform it with Ray Data (map_batches) before passing it.")
    if cfg.train.balance:
        raise UserError("train.balance re-splits the shard set's global batches between ranks; Ray Data's "
                        "streaming_split of your own Dataset cannot be re-split: train on a shard set.")
    if resume:
        log.warning("%s.", RESTART_WARNING)


def _val_rows(cfg: JobConfig, ds: Any) -> Any:
    """The validation rows every eval uses: the first eval_batches x batch_size rows of `ds`."""
    n = cfg.train.eval_batches * cfg.train.batch_size
    try:
        batch = ds.take_batch(n, batch_format="numpy")
    except (ValueError, KeyError) as exc:
        raise UserError(f"cannot take validation rows from the dataset: {exc}") from None
    if "tokens" not in batch:
        raise UserError(f"the dataset has no 'tokens' column (it has {', '.join(batch) or 'none'}).")
    return check_rows(batch["tokens"], None, cfg.train.seq_len + 1, cfg.model.args().vocab_size, "the dataset")


def _torch_config(cfg: JobConfig):
    from .process_group import BoundStoreTorchConfig

    backend = "nccl" if cfg.cluster.use_gpu else "gloo"
    if cfg.cluster.fault_tolerance == "replicas":
        from .replicas import torchft_config

        return torchft_config(backend)
    return BoundStoreTorchConfig(backend=backend)


def summarize(cfg: JobConfig, run: Storage, events: list[dict], wall_s: float, resumed: bool = False) -> dict[str, Any]:
    """The run summary written to summary.json and printed by the CLI."""
    end = next((e for e in reversed(events) if e["event"] == "end"), {})
    progress = [e for e in events if e["event"] == "progress"]
    # The first window includes start-up and compilation, and one window holds the step whose
    # memory was tracked (torch's MemTracker hooks every op, which slows that step a lot; figures:
    # docs/benchmarks.md), so leave both out of the rate when other windows remain.
    steady = [e for e in progress[1:] if not e.get("memory_tracked")] or progress[1:] or progress
    tps = sum(e["tokens_per_s"] for e in steady) / len(steady) if steady else 0.0
    mfu = sum(e.get("mfu", 0.0) for e in steady) / len(steady) if steady else 0.0
    start = next((e for e in reversed(events) if e["event"] == "start"), {})
    steps = list_steps(run)
    return {
        "run": cfg.run.name, "steps": end.get("step", 0), "initial_val_loss": end.get("initial_val_loss"),
        "final_val_loss": end.get("val_loss"), "tokens_per_s": round(tps, 1),
        "tokens_seen": end.get("tokens_seen", 0), "workers": start.get("workers", cfg.cluster.max_workers),
        "restarts": sum(1 for e in events if e["event"] == "restored") - (1 if resumed else 0),
        "restart_causes": [e["cause"] for e in events if e["event"] == "restart"],
        # Fault-tolerant replicas: workers Ray Train replaced while the others went on.
        "replaced_workers": max(0, sum(1 for e in events if e["event"] == "worker") - start.get("workers", 0)),
        "precision": start.get("precision", cfg.precision), "strategy": cfg.parallel.strategy, "stopped_early": end.get("stopped", False),
        "checkpoint": run.child(step_dir(steps[-1])).url if steps else None, "wall_s": round(wall_s, 1),
        "final_loss": progress[-1]["loss"] if progress else None, "mfu": round(mfu, 4),
        "peak_flops": start.get("peak_flops"), "threads": start.get("threads"), "tp": cfg.parallel.tp,
        "skipped_steps": end.get("skipped_steps", 0), "memory": end.get("memory"),
        **_compression_summary(cfg, end.get("comm")), **_pipeline_summary(cfg, steady),
    }


def _pipeline_summary(cfg: JobConfig, steady: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipeline runs: the degree, schedule and the first stage's measured idle share (mean of steady windows)."""
    p = cfg.parallel
    if p.pp == 1:
        return {}
    bubbles = [e["bubble_fraction"] for e in steady if e.get("bubble_fraction") is not None]
    windows = [e["stage_time_shares"] for e in steady if e.get("stage_time_shares")]
    # Per pipeline rank, the mean over the steady windows of each share of its step time.
    shares = [{k: round(sum(w[rank][k] for w in windows) / len(windows), 4) for k in windows[0][rank]}
              for rank in range(len(windows[0]))] if windows else None
    return {"pp": p.pp, "pp_schedule": p.pp_schedule, "pp_microbatches": p.pp_microbatches,
            "bubble_fraction": round(sum(bubbles) / len(bubbles), 4) if bubbles else None,
            "stage_time_shares": shares}


def _compression_summary(cfg: JobConfig, comm: list[dict[str, Any] | None] | None) -> dict[str, Any]:
    """Compressed runs: gradient bytes a rank sent per step (the busiest rank) and the wire_ratio."""
    stats = [c for c in comm or [] if c and c["syncs"]]
    if cfg.compression.codec == "none" or not stats:
        return {}
    return {"compression": {"codec": cfg.compression.codec,
                            "wire_ratio": round(max(c["wire_ratio"] for c in stats), 4),
                            "bytes_per_step_per_rank": round(max(c["bytes_sent"] / c["syncs"] for c in stats))}}


def train(cfg: JobConfig, resume: bool = False, overwrite: bool = False, address: str | None = None,
          on_event: EventSink | None = None, quiet: bool = False,
          stop: threading.Event | None = None, dataset: Any = None, val_dataset: Any = None) -> dict[str, Any]:
    """Run a training job end to end and return its summary (also written to summary.json).

    `dataset`: your own `ray.data.Dataset` of token rows (a 'tokens' column of train.seq_len+1 ids) in
    place of data.source's shard set, fed to the workers with Ray Train's `streaming_split`; a resume
    or retry then starts its epoch over (cs3ray.data.dataset_stream). Validation uses the first rows
    of `val_dataset`, or of `dataset` when none is given.

    The first SIGINT (or setting `stop`, from another thread) asks the workers to checkpoint
    and stop at the next step; a second SIGINT aborts without waiting.
    """
    import ray
    from ray.train import FailureConfig, RunConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .loop import train_loop_per_worker
    from .monitor import RunMonitor

    started = time.time()
    torch_config = _torch_config(cfg)  # a missing torchft is reported before anything is written
    # A shard set named by data.source needs no cluster to check: one that does not fit is refused before a
    # cluster starts or --overwrite clears the run.
    named = named_shard_set(cfg) if dataset is None else None
    run = prepare_run_dir(cfg, resume, overwrite)
    check_tokenizer(cfg, run, resume)
    _check_transform(cfg.data.transform)
    check_loggers(cfg)
    if dataset is not None:
        _check_dataset_config(cfg, resume)
    num_cpus = cfg.cluster.num_cpus or default_num_cpus(cfg.cluster.max_workers, cfg.cluster.cpus_per_worker)
    # Connect first: an unreachable cluster fails in seconds and leaves the run directory
    # empty (not "taken"), before any data is prepared or config written.
    with ray_cluster(address, num_cpus=num_cpus, quiet=quiet, log_format=cfg.run.log_format), \
            process_logs(cfg.run.log_format, "driver", cfg.run.name) as json_log:
        check_placement(cfg, ray.nodes())
        if cfg.checkpoint.memory_tier:
            from cs3ray.ckpt.keeper import start_keepers

            start_keepers()
        if dataset is None:
            shards_url, val_rows = (named or prepare_corpus(cfg, on_event))[0].url, None
        else:
            shards_url, val_rows = None, _val_rows(cfg, val_dataset if val_dataset is not None else dataset)
        run.write_text(to_yaml(cfg), "config.yaml")
        log = EventLog(run)
        metrics = RunMetrics(cfg.run.name)  # Prometheus, on the metrics endpoint of the driver's node
        loggers = open_loggers(cfg, run)  # TensorBoard / MLflow when run.loggers asks
        # On the driver's own node: a monitor on a worker node would die with that node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        monitor = RunMonitor.options(scheduling_strategy=here).remote()
        trainer = _trainer_class()(
            train_loop_per_worker,
            train_loop_config={"job": cfg.model_dump(mode="json"), "run_url": run.url, "shards_url": shards_url,
                               "monitor": monitor, "val_rows": val_rows},
            datasets={"train": dataset} if dataset is not None else None,
            scaling_config=scaling_config(cfg),
            torch_config=torch_config,
            run_config=RunConfig(name=f"cs3-{cfg.run.name}-{int(started)}",
                                 failure_config=FailureConfig(max_failures=cfg.cluster.max_failures)),
            # Without a dataset of the user's, workers read their exact slice of the global order
            # through the node-local cache themselves (see cs3ray.data.stream for why not get_dataset_shard).
        )
        # Ray Train reads this in the driver's environment and passes it to its controller.
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{cfg.cluster.start_timeout_s:g}"
        outcome: dict[str, Any] = {}

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = exc

        thread = threading.Thread(target=fit, name="cs3-fit", daemon=True)
        interrupts = [0]
        previous = None
        if threading.current_thread() is threading.main_thread():
            def on_sigint(signum, frame) -> None:
                interrupts[0] += 1
                if interrupts[0] == 1:
                    monitor.request_stop.remote()
                    if on_event:
                        on_event({"event": "stopping"})
                else:
                    raise KeyboardInterrupt
            previous = signal.signal(signal.SIGINT, on_sigint)
        events: list[dict] = []
        try:
            thread.start()
            stop_sent = False
            while thread.is_alive():
                # Each poll is an actor call that wakes the monitor, the driver and Ray's threads, CPU
                # taken from training: once a second is enough (figures: docs/benchmarks.md).
                thread.join(timeout=POLL_S)
                if stop is not None and stop.is_set() and not stop_sent:
                    monitor.request_stop.remote()
                    stop_sent = True
                events += _drain(monitor, len(events), log, on_event, metrics, loggers, json_log is not None)
            events += _drain(monitor, len(events), log, on_event, metrics, loggers, json_log is not None)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            log.flush()
            close_loggers(loggers)
            metrics.close()
        if "error" in outcome:
            run_log.error("training failed: %s", _worker_error(outcome["error"]))
            raise TrainingError(_worker_error(outcome["error"])) from None
        ray.kill(monitor)
    summary = redact_values(summarize(cfg, run, events, time.time() - started, resumed=resume))  # URLs' passwords
    run.write_text(json.dumps(summary, indent=1), "summary.json")
    return summary


def _trainer_class() -> type:
    """TorchTrainer without Ray Train's placement-group cleaner actor.

    Its liveness check takes a State API miss (frequent on a loaded machine, always without a
    dashboard) for a dead controller and removes the placement group of a run still training, which
    Ray Train then retries from the last checkpoint (ray PR 65447's review names the bug). The cleaner
    exists for groups that outlive their driver; this driver owns its run's group until the end.
    """
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:  # a Ray without the cleaner
        return TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            return [c for c in super()._create_default_callbacks()
                    if not isinstance(c, PlacementGroupCleanerCallback)]

    return Trainer


def _drain(monitor, start: int, log: EventLog, on_event: EventSink | None, metrics: RunMetrics,
           loggers: list[RunLogger], json_log: bool = False) -> list[dict]:
    import ray

    new = ray.get(monitor.events_since.remote(start))
    for e in new:
        log.add(e)
        if json_log:  # the driver's JSON log: each worker event as a line, at the step it happened
            level = logging.WARNING if e["event"] in ("restart", "preemption") else logging.INFO
            run_log.log(level, event_message(e), extra={"event": e["event"], "step": e.get("step")})
        metrics.observe(e)
        observe_all(loggers, e)
        if on_event:
            on_event(e)
    metrics.refresh()
    # Every poll, new events or not: on object storage events wait for the next due write (ops.events).
    log.flush(force=False)
    return new


def _worker_error(exc: BaseException) -> str:
    """The most useful line of a Ray Train failure: the worker's own exception."""
    text = str(exc)
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()
    return lines[-1].strip() if lines else type(exc).__name__
