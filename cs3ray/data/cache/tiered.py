"""The read-through tiered cache: L1 this process's memory -> L2 node-local disk -> L3 the shard set's URL.

`get(name)` looks in L1, then L2, then fetches from L3 once per node (a per-shard file lock:
the node's other workers wait and then read L2) and fills the tiers on the way back. What is
checked against the manifest's sha256, and when: bytes fetched from L3, every time; an L2 file
the first time this process reads it, and again whenever its inode, size or mtime has changed
since (an unchanged file is not re-hashed); L1 holds only bytes already checked, and is not
re-hashed. `prefetch(names)` runs the same path in background threads, so a worker's next
shards are local before it needs them.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from cs3ray.names import check_name
from cs3ray.storage import Storage, open_url

from ..shards import check_rows
from .disk import DiskTier
from .errors import CacheError
from .locking import file_lock
from .memory import MemoryTier
from .policy import make_policy
from .remote import RemoteTier
from .stats import CacheStats, StatsWriter

MAX_PREFETCHED = 32
DEFAULT_DISK_DIR = "~/.cache/cs3ray/shards"


def namespace(url: str) -> str:
    """L2 folder name of a shard set: a hash of its URL."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


class TieredCache:
    """Shard bytes by file name, for one shard set (its manifest entries give sizes and checksums)."""

    def __init__(self, source: Storage, entries: Iterable[dict], memory_bytes: int = 256 * 2**20,
                 disk_bytes: int = 20 * 2**30, disk_dir: str | None = DEFAULT_DISK_DIR,
                 policy: str = "noevict", l1_policy: str | None = None, prefetch_threads: int = 4,
                 retry_deadline_s: float = 60.0, run: str = "") -> None:
        # The names come from the shard set's manifest: each must be a file name before it is joined to a path.
        self.entries = {check_name(e["file"], f"the manifest of '{source.url}'", CacheError): e for e in entries}
        self.remote = RemoteTier(source, retry_deadline_s)
        self.ns = namespace(source.url)
        self.stats = CacheStats()
        self.memory = MemoryTier(memory_bytes, make_policy(l1_policy or policy)) if memory_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, make_policy(policy)) if disk_dir and disk_bytes > 0 else None
        self.writer = StatsWriter(self.stats, self.disk.root if self.disk else None, run=run)
        self._pool = ThreadPoolExecutor(max(1, prefetch_threads), thread_name_prefix="cs3-prefetch")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()

    # -- reads -------------------------------------------------------------------------------
    def get(self, name: str) -> bytes:
        """The verified bytes of shard `name`, from the nearest tier that has them."""
        entry = self._entry(name)
        if self.memory is not None:
            data = self.memory.get(name)
            if data is not None:
                self.stats.add(l1_hits=1, l1_bytes=len(data))
                return data
            self.stats.add(l1_misses=1)
        with self._lock:
            pending = self._inflight.pop(name, None)
        if pending is not None:
            return pending.result()  # prefetched (or being fetched): never fetch twice
        return self._load(name, entry, promote=True)

    def _load(self, name: str, entry: dict, promote: bool) -> bytes:
        def check(b: bytes) -> bool:
            ok = _matches(b, entry)
            if not ok:
                self.stats.add(l2_corrupt=1)
            return ok

        if self.disk is not None:
            data = self.disk.read(self.ns, name, check)
            if data is None:
                self.stats.add(l2_misses=1)
                # One fetch per node: whoever holds the shard's lock fetches, the rest then hit L2.
                with file_lock(self.disk.key_lock(self.ns, name)):
                    data = self.disk.read(self.ns, name, check)
                    if data is None:
                        data = self._fetch(name, entry)
                        adm = self.disk.put(self.ns, name, data)
                        self.stats.add(l2_evictions=adm.evicted)
                    else:
                        self.stats.add(l2_hits=1, l2_bytes=len(data))
            else:
                self.stats.add(l2_hits=1, l2_bytes=len(data))
        else:
            data = self._fetch(name, entry)
        if promote and self.memory is not None:
            _, evicted = self.memory.put(name, data)
            self.stats.add(l1_evictions=evicted)
        self.writer.maybe_flush()
        return data

    def _fetch(self, name: str, entry: dict) -> bytes:
        for _ in range(2):  # a second read rules out corruption in transit
            data = self.remote.read(name, on_retry=lambda exc: self.stats.add(l3_retries=1))
            self.stats.add(l3_reads=1, l3_bytes=len(data))
            if _matches(data, entry):
                check_rows(data, entry, self.remote.url(name))
                return data
        raise CacheError(f"shard '{self.remote.url(name)}' does not match its checksum in the manifest "
                         "(the shard set is corrupt; prepare it again).")

    def _entry(self, name: str) -> dict:
        try:
            return self.entries[name]
        except KeyError:
            raise CacheError(f"'{name}' is not a shard of '{self.remote.storage.url}'.") from None

    # -- background ----------------------------------------------------------------------------
    def prefetch(self, names: Iterable[str]) -> None:
        """Start fetching `names` in the background; `get` then takes the bytes (and L2/L1 keep them if admitted)."""
        for name in names:
            self._entry(name)
            if self.memory is not None and name in self.memory:
                continue
            if self.disk is not None and self.disk.has(self.ns, name) and self.memory is None:
                continue  # a local read on demand is cheaper than a hand-off to a thread
            with self._lock:
                if name in self._inflight:
                    continue
                self._inflight[name] = self._pool.submit(self._prefetch_one, name)
                # Held until a get() takes them; a reader that wanders off must not pin memory forever.
                while len(self._inflight) > MAX_PREFETCHED:
                    self._inflight.pop(next(iter(self._inflight)))

    def _prefetch_one(self, name: str) -> bytes:
        data = self._load(name, self._entry(name), promote=True)
        self.stats.add(prefetched=1)
        return data

    def warm(self, names: list[str], progress=None) -> None:
        """Fill L2 with `names` (bounded by its size); `progress(bytes)` after each shard."""
        if self.disk is None:
            raise CacheError("cache.disk_bytes is 0 or cache.disk_dir is empty: there is no L2 cache to warm.")
        futures = [self._pool.submit(self._load, n, self._entry(n), False) for n in names]
        for n, f in zip(names, futures, strict=True):
            f.result()
            if progress:
                progress(self.entries[n]["bytes"])

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.writer.flush(final=True)

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _matches(data: bytes, entry: dict) -> bool:
    return len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]


_NODE_CACHES: dict[tuple, TieredCache] = {}
_NODE_LOCK = threading.Lock()


def node_cache(url: str, options: dict, entries: list[dict], cache_cfg: dict) -> TieredCache:
    """This process's cache for a shard set (one per process, reused by every read in it)."""
    key = (url, repr(sorted(cache_cfg.items())))
    with _NODE_LOCK:
        cache = _NODE_CACHES.get(key)
        if cache is None:
            cache = _NODE_CACHES[key] = from_config(open_url(url, options), entries, cache_cfg)
        return cache


def from_config(source: Storage, entries: list[dict], cfg: dict) -> TieredCache:
    """A TieredCache from a `cache` config section (as a dict)."""
    return TieredCache(source, entries, memory_bytes=cfg.get("memory_bytes", 256 * 2**20),
                       disk_bytes=cfg.get("disk_bytes", 20 * 2**30), disk_dir=cfg.get("disk_dir", DEFAULT_DISK_DIR),
                       policy=cfg.get("policy", "noevict"), prefetch_threads=max(1, min(4, cfg.get("prefetch", 4))),
                       retry_deadline_s=cfg.get("retry_deadline_s", 60.0), run=cfg.get("run", ""))
