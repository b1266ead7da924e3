"""Decoded token rows: a process's decoded shards, kept for reuse, and the Arrow column rows travel in.

Decoding a shard (parquet -> a (samples, seq_len+1) uint16 array) is the loaders' main CPU cost after
the read, and consecutive micro-batches of the global order draw from the same window of shards, so a
process decodes each shard once and keeps it while it is in use (`DecodedShards`). Rows leave a
process as Arrow's fixed-shape tensor column of uint16 (`token_column`, storage a fixed-size list of
uint16): built from the array and read back into one by Ray Data without a copy, unlike the shards'
variable-length binary rows, which Ray Data can only turn into an array of objects.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable

import numpy as np
import pyarrow as pa


class DecodedShards:
    """Decoded shards by key, least recently used evicted first once over `capacity_bytes`; the newest
    `keep` shards are never evicted (a micro-batch can need a whole window pair of them at once)."""

    def __init__(self, capacity_bytes: int = 0, keep: int = 8) -> None:
        self.capacity_bytes, self.keep = capacity_bytes, keep
        self.decodes = 0  # shards decoded by this cache: counted, as a re-decode is the cost it exists to avoid
        self._rows: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._rows

    def get(self, key: Hashable, load: Callable[[], np.ndarray]) -> np.ndarray:
        """The rows of `key`, decoded with `load()` when this process does not hold them yet."""
        with self._lock:
            rows = self._rows.get(key)
            if rows is not None:
                self._rows.move_to_end(key)
                return rows
        rows = load()  # outside the lock: another thread's hit need not wait for this decode
        with self._lock:
            if key not in self._rows:
                self.decodes += 1
                self._rows[key] = rows
                self._bytes += rows.nbytes
                self._evict()
            return self._rows[key]

    def resize(self, capacity_bytes: int, keep: int) -> None:
        """Hold up to `capacity_bytes` (the larger of two callers' needs wins, as they share the rows)."""
        with self._lock:
            self.capacity_bytes, self.keep = max(self.capacity_bytes, capacity_bytes), max(self.keep, keep)

    def _evict(self) -> None:
        while len(self._rows) > self.keep and self._bytes > self.capacity_bytes:
            _, rows = self._rows.popitem(last=False)
            self._bytes -= rows.nbytes


def token_column(rows: np.ndarray) -> pa.Array:
    """(rows, width) integer tokens as Arrow's fixed-shape tensor column: no copy of a C-contiguous array."""
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(rows))


def rows_table(tokens: np.ndarray, ids: np.ndarray | None = None) -> pa.Table:
    """A Ray Data block of token rows (column 'tokens') and, when given, their sample ids (column 'ids')."""
    columns = {"tokens": token_column(tokens)}
    if ids is not None:
        columns["ids"] = pa.array(ids, type=pa.int64())
    return pa.table(columns)
