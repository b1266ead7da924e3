"""Eviction policies: which cached shards make room for a new one, or whether it is admitted at all.

Training reads every shard once per epoch in a fresh random order. Under that access pattern
LRU thrashes: by the time a shard comes round again it has usually just been evicted, so a
cache holding half the data hits far less than half the time (CoorDL, VLDB'21). `noevict`
("MinIO" in CoorDL) keeps the first shards it admits and refuses the rest, so it hits on
exactly its share of the data every epoch: the best a cache of that size can do here.
`cs3 bench cache` measures both in one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Entry:
    """What a policy may look at: a cached shard's key, size and last use (larger is newer)."""

    key: str
    size: int
    last_used: float


class EvictionPolicy(Protocol):
    name: str

    def victims(self, entries: list[Entry], size: int, used: int, capacity: int) -> list[str] | None:
        """Keys to evict so `size` more bytes fit, or None to refuse the new shard."""


class NoEvict:
    """Admit while there is room, then keep what is there (CoorDL's MinIO)."""

    name = "noevict"

    def victims(self, entries: list[Entry], size: int, used: int, capacity: int) -> list[str] | None:
        return [] if used + size <= capacity else None


class LRU:
    """Evict the least recently used shards until the new one fits."""

    name = "lru"

    def victims(self, entries: list[Entry], size: int, used: int, capacity: int) -> list[str] | None:
        if size > capacity:
            return None
        out, free = [], capacity - used
        for e in sorted(entries, key=lambda e: e.last_used):
            if free >= size:
                break
            out.append(e.key)
            free += e.size
        return out


POLICIES: dict[str, type] = {"noevict": NoEvict, "lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name` ('noevict' or 'lru')."""
    from .errors import CacheError

    if name not in POLICIES:
        raise CacheError(f"unknown cache policy '{name}': use one of {', '.join(POLICIES)}.")
    return POLICIES[name]()
