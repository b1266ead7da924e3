"""The stream of training samples into workers: an exact, resumable global order through the cache.

The order. Epoch e of the train split is a function of (seed, e) alone: the shards are
permuted, then the samples of each window of `shuffle_window` consecutive shards (in that
permuted order) are shuffled together. Epochs follow one another as one endless sequence,
so a global *sample offset* says exactly where a run is. Each micro-batch takes the next
world*batch samples of the sequence and rank r takes the r-th block of batch samples;
every rank therefore knows the offset after each step without talking to the others, and
a checkpoint's `state()` is that offset. Resuming with any number of workers carries on
from it: no sample is skipped and none is repeated (grad_accum needs no special case, as
each micro-batch is a consecutive slice of the sequence).

Why the workers do not read through `ray.train.get_dataset_shard`. Ray Data's
`streaming_split` hands blocks to whichever worker asks first, so which worker sees which
sample, and what a checkpoint would have to record to resume, is not deterministic (ray
issues 37633 and 48224 ask for exactly this). Exactness is the requirement here, so each
worker reads its own deterministic slice straight through the node-local tiered cache
(`cs3ray.data.cache`): shard bytes come from L1 (this process), L2 (the node's disk,
shared with the node's other workers, fetched once per node) or L3 (the shards' URL), the
next shards of the epoch order are prefetched in the background, and every byte is
checked against the manifest. `data.loader: ray_data` delivers the same slice through Ray Data
tasks on the worker's node (cs3ray.data.ray_stream). `train_dataset` gives the driver a Ray
Dataset whose read tasks go through the same node-local cache (a Ray Data datasource) for
consumers that do not need an exact order.
"""

from __future__ import annotations

import io
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import pyarrow.parquet as pq

from cs3ray.storage import Storage, open_url

from .cache import TieredCache, from_config
from .corpus import DataError
from .rows import DecodedShards
from .shards import TOKEN_COLUMN, read_manifest
from .trace import TraceWriter
from .transform import load_transform

log = logging.getLogger(__name__)
ORDER_VERSION = 1
DEFAULT_WINDOW = 4


class GlobalOrder:
    """Sample ids of the train split, epoch after epoch, as a pure function of (seed, epoch)."""

    def __init__(self, entries: list[dict], seed: int, window: int = DEFAULT_WINDOW) -> None:
        self.files = [e["file"] for e in entries]
        counts = np.array([int(e["samples"]) for e in entries], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.total = int(self.starts[-1])
        self.seed, self.window = seed, window
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, (self.seed >> 32) & 0xFFFFFFFF, epoch])

    def epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sample ids in order, shard order, start offset of each window) for one epoch."""
        if epoch not in self._epochs:
            rng = self._rng(epoch)
            shards = rng.permutation(len(self.files))
            parts, bounds = [], [0]
            for g in range(0, len(shards), self.window):
                ids = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards[g:g + self.window]])
                parts.append(ids[rng.permutation(len(ids))])
                bounds.append(bounds[-1] + len(ids))
            self._epochs[epoch] = (np.concatenate(parts), shards, np.array(bounds))
            while len(self._epochs) > 2:  # a slice spans at most two epochs
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def ids(self, start: int, stop: int) -> np.ndarray:
        """Sample ids at global positions [start, stop) of the endless epoch sequence."""
        out, pos = [], start
        while pos < stop:
            e, i = divmod(pos, self.total)
            take = min(stop - pos, self.total - i)
            out.append(self.epoch(e)[0][i:i + take])
            pos += take
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, row in shard) of each sample id."""
        shard = np.searchsorted(self.starts, ids, side="right") - 1
        return shard, ids - self.starts[shard]

    def upcoming(self, position: int, ahead: int) -> list[int]:
        """Shards of the window holding `position` plus the next `ahead` shards of the order."""
        e, i = divmod(position, self.total)
        _, shards, bounds = self.epoch(e)
        g = int(np.searchsorted(bounds, i, side="right") - 1)
        first = g * self.window
        wanted = list(shards[first:first + self.window + ahead])
        if len(wanted) < self.window + ahead:  # the order runs on into the next epoch
            wanted += list(self.epoch(e + 1)[1][: self.window + ahead - len(wanted)])
        return [int(s) for s in wanted]


def decode_shard(data: bytes) -> np.ndarray:
    """Shard bytes -> (samples, seq_len+1) uint16 array, without a Python loop over rows."""
    col = pq.read_table(io.BytesIO(data), columns=[TOKEN_COLUMN]).column(TOKEN_COLUMN).combine_chunks()
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset:col.offset + len(col) + 1]
    width = int(offsets[1] - offsets[0]) if len(col) else 0
    if len(col) == 0 or width % 2 or not np.all(np.diff(offsets) == width):
        raise DataError("a shard's rows are not all one sample length; the shard set is corrupt.")
    raw = np.frombuffer(col.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]
    return raw.view("<u2").reshape(len(col), width // 2)


def gather(order: GlobalOrder, ids: np.ndarray, shard: Callable[[int], np.ndarray],
           dtype: type = np.int64) -> np.ndarray:
    """The (len(ids), seq_len+1) rows of sample `ids` as `dtype`, with `shard(s)` giving shard s's decoded rows."""
    where, row = order.locate(ids)
    batch = np.empty((len(ids), 0), dtype=dtype)
    for s in np.unique(where):
        tokens = shard(int(s))
        if batch.shape[1] == 0:
            batch = np.empty((len(ids), tokens.shape[1]), dtype=dtype)
        mask = where == s
        batch[mask] = tokens[row[mask]]
    return batch


def _ray_train_context() -> tuple[int, int, int, dict]:
    """(rank, world size, local rank, train loop config) inside a Ray Train worker, else (0, 1, 0, {})."""
    try:
        import ray.train

        ctx = ray.train.get_context()
        rank, world, local = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_local_rank()
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return 0, 1, 0, {}
    try:
        # Until the loop passes shards_url explicitly, the train loop config carries it.
        from ray.train.v2._internal.execution.context import get_train_context

        config = dict(get_train_context().train_run_context.train_loop_config or {})
    except Exception:  # noqa: BLE001 - another Ray Train version: explicit arguments are needed
        config = {}
    return rank, world, local, config


class TrainStream:
    """This rank's micro-batches of the global order: (batch, seq_len+1) int64 arrays.

    `position` is what an earlier stream's `state()` returned (from a checkpoint); None starts
    at the first sample. Arguments left None are read from the Ray Train context.
    """

    def __init__(self, batch_size: int, seed: int, position: dict[str, Any] | None = None, *,
                 shards_url: str | None = None, storage_options: dict | None = None,
                 cache: dict | Any | None = None, rank: int | None = None, world: int | None = None,
                 trace_url: str | None = None, transform: str | None = None) -> None:
        ctx_rank, ctx_world, local_rank, loop_cfg = _ray_train_context()
        job = loop_cfg.get("job") or {}
        shards_url = shards_url or loop_cfg.get("shards_url")
        if shards_url is None:
            raise DataError("TrainStream needs shards_url (the prepared shard set) outside a cs3ray training run.")
        if storage_options is None:
            storage_options = (job.get("storage") or {}).get("options") or {}
        if cache is None:
            cache = job.get("cache") or {}
        cache_cfg = cache.model_dump() if hasattr(cache, "model_dump") else dict(cache)
        cache_cfg.setdefault("run", (job.get("run") or {}).get("name", ""))  # the cache's Prometheus `run` tag
        if trace_url is None and cache_cfg.get("trace") and loop_cfg.get("run_url"):
            trace_url = f"{loop_cfg['run_url'].rstrip('/')}/data-trace"
        self.batch_size, self.seed = batch_size, seed
        self.rank = ctx_rank if rank is None else rank
        self.world = ctx_world if world is None else world
        source: Storage = open_url(shards_url, storage_options)
        manifest = read_manifest(source)
        entries = manifest["splits"]["train"]
        self.width = int(manifest["seq_len"]) + 1  # tokens a sample row holds
        self.order = GlobalOrder(entries, seed, int(cache_cfg.get("shuffle_window", DEFAULT_WINDOW)))
        if self.order.total < self.world * batch_size:
            raise DataError(f"the train split holds {self.order.total} samples, fewer than one step of "
                            f"{self.world} workers x train.batch_size {batch_size}; use more data or smaller batches.")
        self.base = self._start(position)
        self.consumed = 0  # micro-batches this stream has produced
        # Rows of each rank's micro-batch when they differ (train.balance); None: batch_size each.
        self.shares: list[int] | None = None
        self.transform_spec = transform
        self._trace = TraceWriter(open_url(trace_url, storage_options)) if trace_url else None
        self._open(source, entries, cache_cfg, local_rank == 0)

    def _open(self, source: Storage, entries: list[dict], cache_cfg: dict, first_on_node: bool) -> None:
        """Set up where the rows come from: here, this process's own tiered cache."""
        self.transform = load_transform(self.transform_spec)
        self.cache: TieredCache = from_config(source, entries, cache_cfg)
        self.ahead = int(cache_cfg.get("prefetch", 4))
        self._decoded = DecodedShards(keep=2 * self.order.window)  # a batch spans at most two windows
        self._window_key: tuple[int, int] | None = None
        if cache_cfg.get("warm") and first_on_node:
            self._warm()

    def _start(self, position: dict[str, Any] | None) -> int:
        if not position:
            return 0
        if position.get("version") != ORDER_VERSION:
            log.warning("checkpoint has a data position of an older format; the data order starts over")
            return 0
        mine = {"seed": self.seed, "window": self.order.window, "train_samples": self.order.total}
        for key, value in mine.items():
            if position.get(key) != value:
                raise DataError(f"the checkpoint's data position was recorded with {key}={position.get(key)}, "
                                f"this run has {key}={value}: resume with the same data, train.seed and "
                                "cache.shuffle_window, or start a new run.")
        return int(position["samples"])

    def _warm(self) -> None:
        t0, names = time.perf_counter(), [self.order.files[s] for s in self.order.upcoming(self.base, 10**9)]
        self.cache.warm(list(dict.fromkeys(names)))
        log.info("warmed the L2 cache with %d shards in %.1fs", len(names), time.perf_counter() - t0)

    @property
    def position(self) -> int:
        """Global sample offset after the micro-batches produced so far (equal on every rank)."""
        return self.base + self.consumed * self.world * self.batch_size

    def reshare(self, shares: list[int] | None) -> None:
        """From the next micro-batch on, rank r takes shares[r] of every micro-batch's world x batch_size
        samples (in rank order: the same samples in the same global order, split differently); None: equal."""
        if shares is not None and (len(shares) != self.world or sum(shares) != self.world * self.batch_size
                                   or min(shares) < 1):
            raise ValueError(f"shares {shares} must give each of {self.world} ranks at least one row and add up "
                             f"to {self.world * self.batch_size}")
        self.base, self.consumed = self.position, 0
        self.shares = None if shares is None or len(set(shares)) == 1 else list(shares)

    def _mine(self) -> tuple[int, int]:
        """(offset in the micro-batch, rows) of this rank's part."""
        if self.shares is None:
            return self.rank * self.batch_size, self.batch_size
        return sum(self.shares[:self.rank]), self.shares[self.rank]

    def seek(self, samples: int, rank: int | None = None, world: int | None = None,
             batch_size: int | None = None) -> None:
        """Continue at global sample offset `samples` as `rank` of `world` with micro-batches of `batch_size`
        (each, when not given, as now).

        Fault-tolerant replicas re-split every step's global batch over the replicas alive for it.
        """
        rank, world = self.rank if rank is None else rank, self.world if world is None else world
        batch_size = self.batch_size if batch_size is None else batch_size
        if self._trace is not None:
            self._trace.drop()  # drawn for a step that did not complete (or nothing)
        if (samples, rank, world, batch_size) != (self.position, self.rank, self.world, self.batch_size):
            if (world, batch_size) != (self.world, self.batch_size):
                self.shares = None  # shares are per rank of this layout
            self.base, self.consumed, self.rank, self.world, self.batch_size = samples, 0, rank, world, batch_size

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> np.ndarray:
        t0 = time.perf_counter()
        offset, rows = self._mine()
        start = self.position + offset
        self._prefetch(self.position)
        ids = self.order.ids(start, start + rows)
        if self._trace is not None:
            self._trace.add(ids)
        batch = gather(self.order, ids, self._shard)
        if self.transform is not None:
            batch = self.transform(batch)
        self.consumed += 1
        self.cache.stats.add(wait_s=time.perf_counter() - t0)
        self.cache.writer.maybe_flush()
        return batch

    def _prefetch(self, position: int) -> None:
        e, i = divmod(position, self.order.total)
        key = (e, int(np.searchsorted(self.order.epoch(e)[2], i, side="right")))
        if key != self._window_key and self.ahead >= 0:
            self._window_key = key
            self.cache.prefetch(self.order.files[s] for s in self.order.upcoming(position, self.ahead)
                                if s not in self._decoded)

    def _shard(self, s: int) -> np.ndarray:
        return self._decoded.get(s, lambda: decode_shard(self.cache.get(self.order.files[s])))

    def state(self) -> dict[str, Any]:
        """JSON-able position for checkpoints: the global sample offset plus what defines the order."""
        return {"version": ORDER_VERSION, "samples": self.position, "epoch": self.position // self.order.total,
                "seed": self.seed, "window": self.order.window, "train_samples": self.order.total,
                "world_size": self.world}

    def trace_step(self, step: int, write: bool = True) -> None:
        """The optimizer step `step` completed: trace the ids drawn for it (with `cache.trace`; see
        cs3ray.data.trace). `write=False` discards them instead (a rank whose group already traces them)."""
        if self._trace is not None:
            self._trace.step(step, self.rank, self.world, write)

    def cache_counters(self) -> dict[str, Any] | None:
        """This process's cache counters so far (progress events carry them, for `cs3 report`)."""
        return self.cache.stats.to_dict()

    def close(self) -> None:
        """Stop prefetching and write the cache counters."""
        self.cache.close()


def train_dataset(shards: Storage, manifest: dict, seed: int, *, cache: dict | Any | None = None):
    """A Ray Dataset of the train split (column 'tokens') whose read tasks use each node's cache.

    Shards come in epoch 0's shard order of (seed); read-task scheduling decides the rest,
    so this dataset is for consumers that do not need the exact order (see the module doc).
    """
    import ray.data

    from .cache.datasource import CachedShardsDatasource

    cache_cfg = cache.model_dump() if hasattr(cache, "model_dump") else dict(cache or {})
    entries = manifest["splits"]["train"]
    order = GlobalOrder(entries, seed, int(cache_cfg.get("shuffle_window", DEFAULT_WINDOW)))
    ordered = [entries[int(s)] for s in order.epoch(0)[1]]
    return ray.data.read_datasource(CachedShardsDatasource(shards.url, shards.options, ordered, cache_cfg))
