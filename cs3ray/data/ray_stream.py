"""`data.loader: ray_data`: each rank's exact slice of the global order, streamed to it by Ray Data.

Why the order stays exact. A read task of this pipeline works out the sample ids of a run of the
rank's next micro-batches from (seed, position, rank, world, batch size) with the same pure function
the direct loader uses (`GlobalOrder`), reads their shards through its node's tiered cache, decodes
and gathers the rows and applies `data.transform`. The rank consumes the results in order
(`preserve_order`), with prefetch, and checks every micro-batch's ids against the order before it
trains on them. Which task runs when changes nothing, so a checkpoint's data position resumes
exactly at any world size, as with the direct loader (cs3ray.data.stream).

Where the work runs. Read tasks are pinned to the worker's own node, so L2 stays node-local and no
rows cross the network, and they reserve no CPU: the training workers hold the node's CPUs, and a
reservation could leave the tasks waiting forever on a fully booked node. Their concurrency is
bounded per rank instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator

import numpy as np

from cs3ray.storage import Storage

from .cache import CacheStats, from_config, node_cache
from .cache.stats import StatsWriter
from .cache.tiered import DEFAULT_DISK_DIR
from .corpus import DataError
from .stream import DEFAULT_WINDOW, GlobalOrder, TrainStream, decode_shard, gather
from .transform import Transform, load_transform

MICRO_BATCHES_PER_TASK = 4
TASKS_IN_FLIGHT = 2  # per rank: enough to hide a shard fetch, few enough to leave the cores to training
HORIZON = 4096  # micro-batches planned per pipeline; another one follows seamlessly

_ORDERS: dict[tuple, GlobalOrder] = {}
_TRANSFORMS: dict[str, Transform | None] = {}
_LOCK = threading.Lock()


def _order(url: str, entries: list[dict], seed: int, window: int) -> GlobalOrder:
    # Ray reuses task processes: one order (and its cached epoch permutations) per process and shard set.
    key = (url, seed, window, len(entries))
    with _LOCK:
        if key not in _ORDERS:
            _ORDERS[key] = GlobalOrder(entries, seed, window)
        return _ORDERS[key]


def _transform(spec: str | None) -> Transform | None:
    with _LOCK:
        if spec not in _TRANSFORMS:
            _TRANSFORMS[spec] = load_transform(spec)
        return _TRANSFORMS[spec]


def _make_datasource(**slice_args: Any):
    from ray.data.datasource import Datasource

    class RankSliceDatasource(Datasource):
        """Micro-batches [0, count) of one rank from global sample offset `start`, MICRO_BATCHES_PER_TASK a task."""

        def __init__(self, url: str, options: dict, entries: list[dict], cache_cfg: dict, seed: int, window: int,
                     start: int, rank: int, world: int, batch: int, count: int, transform: str | None) -> None:
            super().__init__()
            self.args = dict(url=url, options=options, entries=entries, cache_cfg=cache_cfg, seed=seed,
                             window=window, start=start, rank=rank, world=world, batch=batch, transform=transform)
            self.count = count

        def estimate_inmemory_data_size(self) -> int:
            return 0  # unknown until read; a few micro-batches

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None):
            from ray.data.block import BlockMetadata
            from ray.data.datasource import ReadTask

            args, batch = self.args, self.args["batch"]

            def make(first: int, stop: int) -> ReadTask:
                meta = BlockMetadata(num_rows=(stop - first) * batch, size_bytes=None, input_files=None,
                                     exec_stats=None)
                return ReadTask(lambda: _read(first, stop, **args), meta, per_task_row_limit=per_task_row_limit)

            return [make(m, min(m + MICRO_BATCHES_PER_TASK, self.count))
                    for m in range(0, self.count, MICRO_BATCHES_PER_TASK)]

        def get_name(self) -> str:
            return "RankSlice"

    return RankSliceDatasource(**slice_args)


def _read(first: int, stop: int, *, url: str, options: dict, entries: list[dict], cache_cfg: dict, seed: int,
          window: int, start: int, rank: int, world: int, batch: int, transform: str | None) -> Iterator[Any]:
    """Ray Data read task: micro-batches [first, stop) of the rank, one block each."""
    from ray.data.block import BlockAccessor

    cache = node_cache(url, options, entries, cache_cfg)
    order = _order(url, entries, seed, window)
    fn = _transform(transform)
    decoded: OrderedDict[int, np.ndarray] = OrderedDict()

    def shard(s: int) -> np.ndarray:
        if s not in decoded:
            decoded[s] = decode_shard(cache.get(order.files[s]))
            while len(decoded) > 2 * order.window:
                decoded.popitem(last=False)
        return decoded[s]

    # The shards after this task's go to L2 in the background, before the next task asks for them.
    position = start + first * world * batch
    cache.prefetch(order.files[s] for s in order.upcoming(position, int(cache_cfg.get("prefetch", 4))))
    for m in range(first, stop):
        lo = start + m * world * batch + rank * batch
        ids = order.ids(lo, lo + batch)
        rows = gather(order, ids, shard)
        if fn is not None:
            rows = fn(rows)
        yield BlockAccessor.batch_to_block({"tokens": rows, "ids": ids})
    cache.writer.maybe_flush()


class RayDataStream(TrainStream):
    """TrainStream whose rows come from a Ray Data pipeline on this worker's node (same order, same state)."""

    def __init__(self, *args: Any, horizon: int | None = None, **kwargs: Any) -> None:
        self.horizon = horizon or HORIZON
        super().__init__(*args, **kwargs)

    def _open(self, source: Storage, entries: list[dict], cache_cfg: dict, first_on_node: bool) -> None:
        self.transform = None  # applied in the read tasks
        self._slice_args = dict(url=source.url, options=source.options, entries=entries, cache_cfg=cache_cfg,
                                seed=self.seed, window=int(cache_cfg.get("shuffle_window", DEFAULT_WINDOW)),
                                transform=self.transform_spec)
        self.ahead = int(cache_cfg.get("prefetch", 4))
        self._batches: Iterator[dict] | None = None
        # The time this worker waited for data, counted and written as the direct loader's is.
        disk = cache_cfg.get("disk_dir", DEFAULT_DISK_DIR) if cache_cfg.get("disk_bytes", 1) > 0 else None
        self.stats = CacheStats()
        self.writer = StatsWriter(self.stats, os.path.abspath(os.path.expanduser(disk)) if disk else None,
                                  run=cache_cfg.get("run", ""))
        _transform(self.transform_spec)  # a transform that cannot be imported fails here, not in a task
        if cache_cfg.get("warm") and first_on_node:
            self.cache = from_config(source, entries, cache_cfg)
            try:
                self._warm()
            finally:
                self.cache.close()

    def _pipeline(self) -> Iterator[dict]:
        import ray
        import ray.data

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.ERROR)  # no per-pipeline lines in the training log
        source = _make_datasource(**self._slice_args, start=self.position, rank=self.rank, world=self.world,
                                  batch=self.batch_size, count=self.horizon)
        here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
        tasks = -(-self.horizon // MICRO_BATCHES_PER_TASK)  # one block list per task, never re-split
        ds = ray.data.read_datasource(source, num_cpus=0, label_selector=here, concurrency=TASKS_IN_FLIGHT,
                                      override_num_blocks=tasks)
        return iter(ds.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                    prefetch_batches=max(1, self.ahead)))

    def __next__(self) -> np.ndarray:
        t0 = time.perf_counter()
        start = self.position + self.rank * self.batch_size
        if self._batches is None:
            self._batches = self._pipeline()
        try:
            got = next(self._batches)
        except StopIteration:  # the planned horizon is used up: plan the next stretch
            self._batches = None
            return next(self)
        ids = self.order.ids(start, start + self.batch_size)
        if not np.array_equal(got["ids"], ids):
            raise DataError(f"the Ray Data loader delivered samples out of the global order at offset {start} "
                            f"(rank {self.rank} of {self.world}); this is a bug, please report it.")
        if self._trace is not None:
            self._trace.add(ids)
        self.consumed += 1
        self.stats.add(wait_s=time.perf_counter() - t0)
        self.writer.maybe_flush()
        return np.asarray(got["tokens"], dtype=np.int64)

    def seek(self, samples: int, rank: int | None = None, world: int | None = None,
             batch_size: int | None = None) -> None:
        before = (self.position, self.rank, self.world, self.batch_size)
        super().seek(samples, rank, world, batch_size)
        if (self.position, self.rank, self.world, self.batch_size) != before:
            self._stop()  # the running pipeline holds the old slice

    def _stop(self) -> None:
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    def cache_counters(self) -> dict[str, Any] | None:
        """None: the cache is read in Ray Data tasks, which count for themselves."""
        return None

    def close(self) -> None:
        """Stop the pipeline and write this worker's counters (the tasks write their own)."""
        self._stop()
        self.writer.flush(final=True)
