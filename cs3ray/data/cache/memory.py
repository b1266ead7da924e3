"""L1: shard bytes in this process's memory, never more than `capacity` bytes."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from .policy import Entry, EvictionPolicy


class MemoryTier:
    """A byte-bounded map of shard key -> bytes with a pluggable eviction policy."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        self.capacity, self.policy = capacity, policy
        self.used = 0
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._last: dict[str, int] = {}
        self._clock = itertools.count()  # a logical clock: orders uses without calling time()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is not None:
                self._last[key] = next(self._clock)
            return data

    def put(self, key: str, data: bytes) -> tuple[bool, int]:
        """Store `data` if the policy admits it; returns (stored, shards evicted)."""
        with self._lock:
            if key in self._data:
                return True, 0
            entries = [Entry(k, len(v), self._last[k]) for k, v in self._data.items()]
            victims = self.policy.victims(entries, len(data), self.used, self.capacity)
            if victims is None:
                return False, 0
            for k in victims:
                self.used -= len(self._data.pop(k))
                del self._last[k]
            if self.used + len(data) > self.capacity:  # a policy bug must not break the bound
                return False, len(victims)
            self._data[key] = data
            self._last[key] = next(self._clock)
            self.used += len(data)
            return True, len(victims)

    def drop(self, key: str) -> None:
        with self._lock:
            data = self._data.pop(key, None)
            if data is not None:
                self.used -= len(data)
                del self._last[key]

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
