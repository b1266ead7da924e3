"""`cs3 bench cache`: shuffled epochs over a loopback S3 store, direct vs fsspec filecache vs cs3's cache.

One run, one dataset of random-token shards on a moto S3 server behind a proxy that adds
per-request latency (a stand-in for a remote store). Each mode reads every shard once per
epoch in a new random order, for 3 epochs, and we report MB/s of shard bytes delivered:

  direct     s3fs `cat_file`, no cache (what reading object storage each epoch costs)
  filecache  fsspec's `filecache` over the same s3fs options (whole-file local copies)
  cs3        cs3ray's TieredCache, L2 sized at 100% and 50% of the data (default policy),
             and the 50% case again with LRU; L1 is off so the numbers are the disk tier's,
             prefetching `prefetch` shards ahead as training does, checksums verified
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np

from cs3ray.data.cache import TieredCache
from cs3ray.data.shards import write_shard
from cs3ray.data.stream import GlobalOrder
from cs3ray.storage import open_url

from .loopback_s3 import LatencyProxy, MotoServer, make_bucket, s3_options

BUCKET = "cs3"


def _make_dataset(total_mb: int, shard_mb: float, seq_len: int, local: str) -> list[dict]:
    """Random-token shards (the cs3ray shard format) under `local`; returns manifest entries."""
    rng = np.random.default_rng(0)
    rows = max(16, int(shard_mb * 2**20 / ((seq_len + 1) * 2)))
    dest, entries = open_url(local), []
    while sum(e["bytes"] for e in entries) < total_mb * 2**20:
        # Uniform ids over 16 bits do not compress, so the bytes moved are the bytes counted.
        samples = rng.integers(0, 2**16, size=(rows, seq_len + 1), dtype=np.uint16)
        entries.append(write_shard(dest, f"train-{len(entries):05d}.parquet", samples))
    return entries


def _epochs(read: Callable[[str], int], order: GlobalOrder, epochs: int,
            on_epoch: Callable[[int], None] | None = None) -> list[float]:
    """MB/s of each epoch: every shard once, in that epoch's permutation."""
    out = []
    for e in range(epochs):
        names = [order.files[s] for s in order.epoch(e)[1]]
        t0, n = time.perf_counter(), 0
        for i, name in enumerate(names):
            n += read(name, names[i + 1:])
        out.append(n / 2**20 / (time.perf_counter() - t0))
        if on_epoch:
            on_epoch(e)
    return out


def run(size_mb: int = 256, latency_ms: float = 20.0, epochs: int = 3, prefetch: int = 4,
        quick: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every mode; returns the issue's JSON keys plus per-epoch detail."""
    import fsspec
    import s3fs

    say = log or (lambda m: None)
    if quick:
        size_mb, latency_ms = min(size_mb, 24), min(latency_ms, 10.0)
    work = tempfile.mkdtemp(prefix="cs3-bench-cache-")
    moto = MotoServer()
    proxy = None
    try:
        say(f"making {size_mb} MB of shards")
        entries = _make_dataset(size_mb, 1.0 if quick else 2.0, 1023, os.path.join(work, "src"))
        total = sum(e["bytes"] for e in entries)
        make_bucket(moto.url, BUCKET)
        s3fs.S3FileSystem(**s3_options(moto.url), skip_instance_cache=True).put(
            os.path.join(work, "src") + "/", f"{BUCKET}/data/", recursive=True)
        proxy = LatencyProxy(moto.url, latency_ms / 1000)
        options = s3_options(proxy.url)
        url = f"s3://{BUCKET}/data"
        order = GlobalOrder(entries, seed=1, window=1)
        result: dict[str, Any] = {"dataset_mb": round(total / 2**20, 1), "shards": len(entries),
                                  "latency_ms": latency_ms, "epochs": epochs, "prefetch": prefetch}

        say("direct s3fs")
        direct_fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        direct_fs.info(f"{BUCKET}/data/{entries[0]['file']}")  # connect before timing, as every mode does
        direct = _epochs(lambda n, rest: len(direct_fs.cat_file(f"{BUCKET}/data/{n}")), order, epochs)

        say("fsspec filecache")
        fc = fsspec.filesystem("filecache", target_protocol="s3", target_options=options,
                               cache_storage=os.path.join(work, "filecache"), skip_instance_cache=True)

        def fc_read(n: str, rest) -> int:
            with fc.open(f"{BUCKET}/data/{n}", "rb") as f:
                return len(f.read())

        fc.info(f"{BUCKET}/data/{entries[0]['file']}")
        filecache = _epochs(fc_read, order, epochs)

        def cs3(fraction: float, policy: str) -> tuple[list[float], float]:
            disk = os.path.join(work, f"l2-{policy}-{fraction}")
            cache = TieredCache(open_url(url, options), entries, memory_bytes=0, disk_bytes=int(total * fraction),
                                disk_dir=disk, policy=policy, prefetch_threads=max(1, prefetch))
            marks = []
            cache.remote.storage.fs.info(cache.remote.storage.path(entries[0]["file"]))

            def read(n: str, rest: list[str]) -> int:
                cache.prefetch(rest[:prefetch])
                return len(cache.get(n))

            with cache:
                speeds = _epochs(read, order, epochs, on_epoch=lambda e: marks.append(cache.stats.copy()))
            later = marks[-1].minus(marks[0])
            hits = later.l2_hits / max(1, later.l2_hits + later.l2_misses)
            shutil.rmtree(disk, ignore_errors=True)
            return speeds, hits

        say("cs3 cache, L2 = 100% of the data")
        full, hit_full = cs3(1.0, "noevict")
        say("cs3 cache, L2 = 50%, noevict")
        half, hit_half = cs3(0.5, "noevict")
        say("cs3 cache, L2 = 50%, lru")
        half_lru, hit_half_lru = cs3(0.5, "lru")
        warm = lambda xs: xs[1] if len(xs) > 1 else xs[0]  # noqa: E731 - the second epoch
        result.update({
            "direct_mb_s": round(float(np.mean(direct)), 2),
            "fsspec_filecache_mb_s": round(warm(filecache), 2),
            "cs3_epoch1_mb_s": round(full[0], 2),
            "cs3_epoch2_mb_s": round(warm(full), 2),
            "epoch2_speedup": round(warm(full) / float(np.mean(direct)), 2),
            "hit_rate_half": round(hit_half, 3),
            "hit_rate_half_lru": round(hit_half_lru, 3),
            "per_epoch_mb_s": {"direct": _r(direct), "fsspec_filecache": _r(filecache), "cs3_100": _r(full),
                               "cs3_50_noevict": _r(half), "cs3_50_lru": _r(half_lru)},
            "hit_rate_full": round(hit_full, 3),
        })
        return result
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


def _r(xs: list[float]) -> list[float]:
    return [round(x, 2) for x in xs]


JSON_KEYS = ("direct_mb_s", "fsspec_filecache_mb_s", "cs3_epoch1_mb_s", "cs3_epoch2_mb_s", "epoch2_speedup",
             "hit_rate_half", "hit_rate_half_lru")


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: mode, MB/s of each epoch, hit rate over epochs 2.. where it applies."""
    hit = {"cs3_100": r["hit_rate_full"], "cs3_50_noevict": r["hit_rate_half"], "cs3_50_lru": r["hit_rate_half_lru"]}
    return [(mode, *speeds, hit.get(mode, "-")) for mode, speeds in r["per_epoch_mb_s"].items()]
