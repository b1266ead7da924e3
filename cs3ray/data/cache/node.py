"""A node's L2 cache as a whole: warm it from a shard set, sum its processes' counters, clear it.

`cs3 cache warm|stats|clear` call these; so can a job or a notebook, with the same `cache` section.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from cs3ray.storage import open_url

from ..shards import read_manifest
from .disk import DiskTier
from .errors import CacheError
from .policy import NoEvict
from .stats import read_all, total
from .tiered import TieredCache

if TYPE_CHECKING:
    from cs3ray.config.schema import CacheConfig

WARM_THREADS = 8  # warming has nothing else to do: more parallel reads than a training worker's prefetch


def warm_node(url: str, cache: "CacheConfig", storage_options: dict | None = None, split: str = "train",
              progress: Callable[[int, int], None] | None = None) -> dict:
    """Copy shard set `url`'s `split` into this node's L2 (up to cache.disk_bytes); a summary of what it holds.

    `progress(bytes_done, bytes_total)` is called once with 0 before the first shard, then after each.
    """
    source = open_url(url, storage_options or {})
    manifest = read_manifest(source)
    entries = manifest["splits"].get(split)
    if not entries:
        raise CacheError(f"split '{split}' is not in the manifest (splits: {', '.join(manifest['splits'])})")
    want = sum(e["bytes"] for e in entries)
    t0 = time.perf_counter()
    with TieredCache(source, entries, memory_bytes=0, disk_bytes=cache.disk_bytes, disk_dir=cache.disk_dir,
                     policy=cache.policy, prefetch_threads=max(1, min(WARM_THREADS, cache.prefetch)),
                     retry_deadline_s=cache.retry_deadline_s) as tiers:
        if progress:
            progress(0, want)
        tiers.warm([e["file"] for e in entries], progress=(lambda n: progress(n, want)) if progress else None)
    files, used = tiers.disk.usage()
    cached = sum(1 for e in entries if tiers.disk.has(tiers.ns, e["file"]))
    return {"url": source.url, "split": split, "shards": len(entries), "cached_shards": cached,
            "bytes": want, "l3_bytes": tiers.stats.l3_bytes, "seconds": round(time.perf_counter() - t0, 2),
            "disk_dir": tiers.disk.root, "disk_used_bytes": used, "disk_bytes": cache.disk_bytes}


def node_stats(cache: "CacheConfig") -> dict:
    """This node's L2 usage and its processes' counters, summed (hits, misses and bytes per tier, L3 reads, wait)."""
    tier = DiskTier(cache.disk_dir, cache.disk_bytes, NoEvict())
    files, used = tier.usage()
    procs = read_all(tier.root)
    s = total(procs)
    return {"disk_dir": tier.root, "disk_files": files, "disk_used_bytes": used, "disk_bytes": cache.disk_bytes,
            "processes": len(procs), "hit_rate": round(s.hit_rate(), 4), **s.to_dict()}


def clear_node(cache: "CacheConfig") -> dict:
    """Delete every shard in this node's L2 directory (the counters are kept); where, and the bytes freed."""
    tier = DiskTier(cache.disk_dir, cache.disk_bytes, NoEvict())
    return {"disk_dir": tier.root, "freed_bytes": tier.clear()}
