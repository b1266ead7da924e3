"""`data.loader: ray_data`: each rank's exact slice of the global order, streamed to it by Ray Data.

Why the order stays exact. A read task of this pipeline works out the sample ids of a run of the
rank's next micro-batches from (seed, position, rank, world, batch size) with the same pure function
the direct loader uses (`GlobalOrder`), reads their shards through its node's tiered cache, and
gathers the rows; `data.transform`, when set, is a `map_batches` stage after the read. The rank
consumes the results in order (`preserve_order`), with prefetch, and checks every micro-batch's ids
against the order before it trains on them. Which task runs when changes nothing, so a checkpoint's
data position resumes exactly at any world size, as with the direct loader (cs3ray.data.stream).

What Ray Data sees. Both stages declare their CPU (`data.loader_cpus` a task) and their memory: the
task process itself, its decoded shards (`cache.memory_bytes`, or a window pair of shards if more:
they are this loader's L1, so the raw-bytes L1 is off in its tasks) and the task's blocks. Ray's
scheduler and Ray Data's resource accounting and backpressure therefore count them. The transform
stage takes whole blocks and calls `data.transform` per micro-batch, so Ray Data fuses it into the
read task (one task, no extra trip through the object store). Rows are Arrow's fixed-shape uint16
tensor column (cs3ray.data.rows), so each block's size is known in advance and it converts to and
from numpy without copies.

Where the work runs. Tasks are pinned to the worker's own node, so L2 stays node-local and no rows
cross the network, with TASKS_IN_FLIGHT of them per rank. A Ray worker process runs many read tasks
in turn: it fetches the manifest once (an object ref the stream puts once, never a copy in each
task's closure), builds the order and the node cache once, and decodes each shard once while it
keeps it (`DecodedShards`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from cs3ray.storage import Storage

from .cache import CacheStats, TieredCache, from_config, node_cache
from .cache.stats import StatsWriter
from .cache.tiered import DEFAULT_DISK_DIR
from .corpus import DataError
from .ray_settings import ray_data_settings
from .rows import DecodedShards, rows_table
from .stream import DEFAULT_WINDOW, GlobalOrder, TrainStream, decode_shard, gather
from .transform import Transform, load_transform

MICRO_BATCHES_PER_TASK = 4
TASKS_IN_FLIGHT = 2  # per rank: enough to hide a shard fetch, few enough to leave the cores to training
HORIZON = 4096  # micro-batches planned per pipeline; another one follows seamlessly
DEFAULT_CPUS = 0.25  # a task mostly waits on the cache and gathers rows: a quarter core, as data.loader_cpus
# A Ray worker process with numpy, pyarrow and Ray Data loaded, before it holds any rows (Ray Data's memory
# check measured about 233 MiB): part of what a task needs, so part of what it declares.
PROCESS_BYTES = 256 * 2**20
SHARD_SETS_KEPT = 4  # shard sets (orders and caches) a task process keeps: one per run, a few over its life

_LOCK = threading.Lock()
_SHARD_SETS: OrderedDict[tuple, tuple[GlobalOrder, TieredCache]] = OrderedDict()
_DECODED = DecodedShards()  # this process's decoded shards, shared by every read task it runs
_TRANSFORMS: dict[str, Transform | None] = {}


@dataclass(frozen=True)
class SliceSpec:
    """What a read task needs besides the manifest (which travels once, by reference): a few names and numbers."""

    url: str
    options: dict
    cache_cfg: dict  # the task's: its L1 is the decoded shards, so the raw-bytes L1 is off
    manifest_key: str  # the train split's digest: a process reuses its order and cache for the same one
    seed: int
    window: int
    start: int
    rank: int
    world: int
    batch: int
    decoded_bytes: int  # what the process's decoded shards may hold


def decodes() -> int:
    """Shards this process has decoded for the loader so far (each once while it keeps it)."""
    return _DECODED.decodes


def _shard_set(spec: SliceSpec, entries_ref: Any) -> tuple[GlobalOrder, TieredCache]:
    """This process's order and node cache for the spec's shard set; the manifest is fetched on first use only."""
    key = (spec.manifest_key, spec.url, spec.seed, spec.window, repr(sorted(spec.cache_cfg.items())))
    with _LOCK:
        if key in _SHARD_SETS:
            _SHARD_SETS.move_to_end(key)
            return _SHARD_SETS[key]
    import ray

    entries = ray.get(entries_ref)
    made = GlobalOrder(entries, spec.seed, spec.window), node_cache(spec.url, spec.options, entries, spec.cache_cfg)
    with _LOCK:
        _SHARD_SETS[key] = made
        while len(_SHARD_SETS) > SHARD_SETS_KEPT:
            _SHARD_SETS.popitem(last=False)
    return made


def _transform(spec: str | None) -> Transform | None:
    with _LOCK:
        if spec not in _TRANSFORMS:
            _TRANSFORMS[spec] = load_transform(spec)
        return _TRANSFORMS[spec]


def _read(first: int, stop: int, spec: SliceSpec, entries_ref: Any) -> Iterator[pa.Table]:
    """Ray Data read task: micro-batches [first, stop) of the rank, one block each."""
    order, cache = _shard_set(spec, entries_ref)
    _DECODED.resize(spec.decoded_bytes, 2 * order.window)  # a micro-batch spans at most two windows

    def key(s: int) -> tuple:
        name = order.files[s]
        return spec.url, name, cache.entries[name].get("sha256")

    def shard(s: int) -> np.ndarray:
        return _DECODED.get(key(s), lambda: decode_shard(cache.get(order.files[s])))

    # The shards after this task's go to L2 in the background, before the next task asks for them.
    position = spec.start + first * spec.world * spec.batch
    ahead = order.upcoming(position, int(spec.cache_cfg.get("prefetch", 4)))
    cache.prefetch(order.files[s] for s in ahead if key(s) not in _DECODED)
    for m in range(first, stop):
        lo = spec.start + m * spec.world * spec.batch + spec.rank * spec.batch
        ids = order.ids(lo, lo + spec.batch)
        yield rows_table(gather(order, ids, shard, dtype=np.uint16), ids)
    cache.writer.maybe_flush()


def _apply_transform(batch: dict[str, np.ndarray], transform: str, rows: int) -> pa.Table:
    """map_batches stage: `data.transform` on each micro-batch (`rows` rows) of a block, called with int64
    rows as the direct loader calls it. Per micro-batch whatever the block's size, so that Ray Data may fuse
    the stage into the read task (a stage with a batch size would not be)."""
    fn = _transform(transform)
    tokens = np.asarray(batch["tokens"], dtype=np.int64)
    out = [fn(tokens[i:i + rows]) for i in range(0, len(tokens), rows)]
    return rows_table(np.concatenate(out) if out else tokens, batch["ids"])


def _make_datasource(spec: SliceSpec, entries_ref: Any, count: int, row_bytes: int):
    from ray.data.datasource import Datasource

    class RankSliceDatasource(Datasource):
        """Micro-batches [0, count) of one rank from the spec's global offset, MICRO_BATCHES_PER_TASK a task."""

        def estimate_inmemory_data_size(self) -> int:
            return count * spec.batch * row_bytes

        def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None):
            from ray.data.block import BlockMetadata
            from ray.data.datasource import ReadTask

            def make(first: int, stop: int) -> ReadTask:
                rows = (stop - first) * spec.batch
                meta = BlockMetadata(num_rows=rows, size_bytes=rows * row_bytes, input_files=None, exec_stats=None)
                return ReadTask(lambda: _read(first, stop, spec, entries_ref), meta,
                                per_task_row_limit=per_task_row_limit)

            return [make(m, min(m + MICRO_BATCHES_PER_TASK, count)) for m in range(0, count, MICRO_BATCHES_PER_TASK)]

        def get_name(self) -> str:
            return "RankSlice"

    return RankSliceDatasource()


def _check_room(cpus: float) -> None:
    """Inside Ray Train: one clear error, not a pipeline waiting forever, when the workers hold all of their
    node's CPUs and leave none for a read task."""
    if cpus <= 0:
        return
    try:
        import ray
        import ray.train

        local_workers = ray.train.get_context().get_local_world_size()
    except Exception:  # noqa: BLE001 - not a Ray Train worker: nothing to compare against
        return
    node = ray.get_runtime_context().get_node_id()
    total = next((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["NodeID"] == node), 0.0)
    held = local_workers * ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    if total - held < cpus:
        raise DataError(f"data.loader=ray_data: this node's {local_workers} workers hold {held:g} of its {total:g} "
                        f"CPUs, leaving none for a read task (data.loader_cpus={cpus:g} each); lower "
                        "cluster.cpus_per_worker, add CPUs, or set data.loader_cpus=0.")


class RayDataStream(TrainStream):
    """TrainStream whose rows come from a Ray Data pipeline on this worker's node (same order, same state)."""

    def __init__(self, *args: Any, horizon: int | None = None, cpus: float = DEFAULT_CPUS, **kwargs: Any) -> None:
        self.horizon, self.cpus = horizon or HORIZON, cpus
        super().__init__(*args, **kwargs)

    def _open(self, source: Storage, entries: list[dict], cache_cfg: dict, first_on_node: bool) -> None:
        import ray

        self.transform = None  # applied in a map_batches stage
        _transform(self.transform_spec)  # a transform that cannot be imported fails here, not in a task
        _check_room(self.cpus)
        window = int(cache_cfg.get("shuffle_window", DEFAULT_WINDOW))
        widest = max(int(e["samples"]) for e in entries) * self.width * 2
        digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
        self._spec = dict(url=source.url, options=source.options, cache_cfg={**cache_cfg, "memory_bytes": 0},
                          manifest_key=digest, seed=self.seed, window=window,
                          decoded_bytes=max(int(cache_cfg.get("memory_bytes", 256 * 2**20)), 2 * window * widest))
        self._entries_ref = ray.put(entries)  # the manifest travels once; tasks hold a reference
        self.ahead = int(cache_cfg.get("prefetch", 4))
        self._batches: Iterator[dict] | None = None
        # The time this worker waited for data, counted and written as the direct loader's is.
        disk = cache_cfg.get("disk_dir", DEFAULT_DISK_DIR) if cache_cfg.get("disk_bytes", 1) > 0 else None
        self.stats = CacheStats()
        self.writer = StatsWriter(self.stats, os.path.abspath(os.path.expanduser(disk)) if disk else None,
                                  run=cache_cfg.get("run", ""))
        if cache_cfg.get("warm") and first_on_node:
            self.cache = from_config(source, entries, cache_cfg)
            try:
                self._warm()
            finally:
                self.cache.close()

    def resources(self) -> dict[str, float]:
        """What each task of this stream's pipeline declares to Ray: CPU, and bytes of memory (its process, the
        process's decoded shards, its output blocks and a transform's int64 copy of them)."""
        blocks = MICRO_BATCHES_PER_TASK * self.batch_size * (self.width * (2 + 8 + 8) + 8)
        return {"num_cpus": self.cpus, "memory": PROCESS_BYTES + self._spec["decoded_bytes"] + blocks}

    def dataset(self, count: int | None = None):
        """The Ray Dataset of this rank's next `count` (default: the horizon's) micro-batches from its position."""
        import ray
        import ray.data

        count = count or self.horizon
        spec = SliceSpec(**self._spec, start=self.position, rank=self.rank, world=self.world, batch=self.batch_size)
        source = _make_datasource(spec, self._entries_ref, count, self.width * 2 + 8)
        here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
        tasks = -(-count // MICRO_BATCHES_PER_TASK)  # one block list per task, never re-split
        stage = dict(compute=ray.data.TaskPoolStrategy(size=min(TASKS_IN_FLIGHT, tasks)), label_selector=here,
                     **self.resources())
        ds = ray.data.read_datasource(source, override_num_blocks=tasks, **stage)
        if self.transform_spec:
            ds = ds.map_batches(_apply_transform, batch_size=None, batch_format="numpy", zero_copy_batch=True,
                                fn_kwargs={"transform": self.transform_spec, "rows": self.batch_size}, **stage)
        return ds

    def _pipeline(self) -> Iterator[dict]:
        with ray_data_settings(preserve_order=True):
            ds = self.dataset()
            yield from ds.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                       prefetch_batches=max(1, self.ahead))

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
