"""The tiered cache without Ray: policies, byte bounds, promotion, integrity, disk full, two processes."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import random

import pytest

from cs3ray.config.schema import CacheConfig
from cs3ray.data.cache import LRU, CacheError, NoEvict, TieredCache, clear_node, node_stats, warm_node
from cs3ray.data.cache import disk as disk_mod
from cs3ray.data.cache.disk import DiskTier
from cs3ray.data.cache.memory import MemoryTier
from cs3ray.data.cache.policy import Entry
from cs3ray.storage import open_url

from helpers.shard_sets import make_shard_set


def test_policies_choose_victims():
    es = [Entry("a", 10, 1.0), Entry("b", 10, 3.0), Entry("c", 10, 2.0)]
    assert LRU().victims(es, 15, 30, 40) == ["a"]
    assert LRU().victims(es, 25, 30, 40) == ["a", "c"]
    assert LRU().victims(es, 50, 30, 40) is None
    assert NoEvict().victims(es, 10, 30, 40) == []
    assert NoEvict().victims(es, 11, 30, 40) is None


@pytest.mark.parametrize("policy", [LRU(), NoEvict()])
def test_memory_tier_never_exceeds_its_bound(policy):
    tier, rng = MemoryTier(1000, policy), random.Random(0)
    for _ in range(500):
        key = f"k{rng.randrange(40)}"
        if tier.get(key) is None:
            tier.put(key, b"x" * rng.randrange(1, 400))
        assert tier.used <= 1000
        assert tier.used == sum(len(tier.get(k)) for k in list(tier._data))


@pytest.mark.parametrize("policy", [LRU(), NoEvict()])
def test_disk_tier_never_exceeds_its_bound(tmp_path, policy):
    tier, rng = DiskTier(str(tmp_path / "l2"), 5000, policy), random.Random(1)
    for i in range(200):
        name = f"s{rng.randrange(30)}"
        data = bytes([i % 256]) * rng.randrange(1, 2000)
        tier.put("ns", name, data)
        assert tier.usage()[1] <= 5000


def test_read_through_promotes_and_counts(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=4)
    entries = manifest["splits"]["train"]
    names = [e["file"] for e in entries]
    with TieredCache(open_url(src), entries, memory_bytes=10**8, disk_bytes=10**9, disk_dir=str(tmp_path / "l2")) as c:
        n = len(names)
        first = [c.get(n) for n in names]
        assert (c.stats.l3_reads, c.stats.l2_misses, c.stats.l1_misses) == (n, n, n)
        assert [c.get(n) for n in names] == first
        assert c.stats.l1_hits == n and c.stats.l3_reads == n
    # A new process-level cache (empty L1) over the same L2: served from disk, not L3.
    with TieredCache(open_url(src), entries, memory_bytes=10**8, disk_bytes=10**9, disk_dir=str(tmp_path / "l2")) as c:
        assert [c.get(n) for n in names] == first
        assert (c.stats.l2_hits, c.stats.l3_reads, c.stats.l3_bytes) == (n, 0, 0)
        assert c.stats.l2_bytes == sum(e["bytes"] for e in entries)


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_bad_l2_file_is_dropped_and_fetched_again(tmp_path, damage):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=2)
    entries = manifest["splits"]["train"]
    name = entries[0]["file"]
    with TieredCache(open_url(src), entries, memory_bytes=0, disk_dir=str(tmp_path / "l2")) as c:
        good = c.get(name)
        path = c.disk.path(c.ns, name)
    with open(path, "r+b") as f:
        if damage == "corrupt":
            f.seek(len(good) // 2)
            f.write(bytes(255 - b for b in good[len(good) // 2:len(good) // 2 + 3]))
        else:
            f.truncate(len(good) // 3)
    # Another worker process (its own L1, no memory of the file) finds the damage.
    with TieredCache(open_url(src), entries, memory_bytes=0, disk_dir=str(tmp_path / "l2")) as c:
        assert c.get(name) == good
        assert c.stats.l2_corrupt == 1 and c.stats.l3_reads == 1
        with open(path, "rb") as f:
            assert f.read() == good  # the refetched copy replaced the bad one


def test_disk_full_evicts_instead_of_failing(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path / "l2"), 10**6, NoEvict())
    tier.put("ns", "a", b"a" * 100)
    tier.put("ns", "b", b"b" * 100)
    real, calls = disk_mod._atomic_write, []

    def full_once(target, data):
        calls.append(target)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(target, data)

    monkeypatch.setattr(disk_mod, "_atomic_write", full_once)
    assert tier.put("ns", "c", b"c" * 100).stored
    assert tier.usage() == (2, 200)  # one older shard made room
    monkeypatch.setattr(disk_mod, "_atomic_write",
                        lambda t, d: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    assert not tier.put("ns", "d", b"d" * 100).stored  # nothing left to evict: served uncached, no error
    assert tier.usage() == (0, 0)


def test_crashed_writers_temp_files_do_not_count(tmp_path):
    tier = DiskTier(str(tmp_path / "l2"), 1000, NoEvict())
    os.makedirs(tmp_path / "l2" / "ns")
    (tmp_path / "l2" / "ns" / f"x{disk_mod.TMP}deadbeef").write_bytes(b"z" * 900)
    assert tier.put("ns", "a", b"a" * 500).stored
    assert tier.usage() == (1, 500)


def test_missing_shard_is_one_clear_error(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=2)
    entries = manifest["splits"]["train"]
    os.remove(os.path.join(src, entries[1]["file"]))
    with TieredCache(open_url(src), entries, disk_dir=str(tmp_path / "l2"), retry_deadline_s=2) as c:
        with pytest.raises(CacheError, match="does not exist"):
            c.get(entries[1]["file"])
        with pytest.raises(CacheError, match="not a shard"):
            c.get("nope.parquet")


def test_warm_stats_and_clear_a_nodes_l2(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=3)
    entries = manifest["splits"]["train"]
    want = sum(e["bytes"] for e in entries)
    # One fetch thread: shards arrive in order, so all but the last fit.
    cache = CacheConfig(disk_dir=str(tmp_path / "l2"), disk_bytes=want - entries[-1]["bytes"], prefetch=1)
    seen: list[tuple[int, int]] = []
    summary = warm_node(src, cache, progress=lambda n, total: seen.append((n, total)))
    assert seen[0] == (0, want) and sum(n for n, _ in seen) == want and {t for _, t in seen} == {want}
    assert (summary["shards"], summary["cached_shards"], summary["bytes"]) == (len(entries), len(entries) - 1, want)
    assert summary["l3_bytes"] == want and summary["disk_used_bytes"] == want - entries[-1]["bytes"]
    stats = node_stats(cache)
    assert (stats["disk_files"], stats["l3_reads"], stats["processes"]) == (len(entries) - 1, len(entries), 1)
    assert clear_node(cache) == {"disk_dir": str(tmp_path / "l2"), "freed_bytes": summary["disk_used_bytes"]}
    assert node_stats(cache)["disk_files"] == 0
    with pytest.raises(CacheError, match=r"split 'test' is not in the manifest \(splits: "):
        warm_node(src, cache, split="test")


def _reader(src: str, entries: list, l2: str, order_seed: int, out) -> None:
    with TieredCache(open_url(src), entries, memory_bytes=0, disk_dir=l2) as c:
        names = [e["file"] for e in entries]
        random.Random(order_seed).shuffle(names)
        ok = all(len(c.get(n)) == next(e["bytes"] for e in entries if e["file"] == n) for n in names)
        out.put((ok, c.stats.l3_reads))


def test_two_processes_share_l2_and_fetch_each_shard_once(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=12)
    entries = manifest["splits"]["train"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(src, entries, str(tmp_path / "l2"), seed, out)) for seed in (1, 2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(ok for ok, _ in results)
    assert sum(n for _, n in results) == len(entries)  # the lock made the node fetch each shard once
    assert not [n for n in os.listdir(tmp_path / "l2" / os.listdir(tmp_path / "l2")[0]) if disk_mod.TMP in n]


def test_hit_rate_is_the_share_of_reads_that_needed_no_remote_fetch():
    from cs3ray.data.cache import CacheStats

    # Prefetch threads read L2 without an L1 miss of their own: the rate still stays within [0, 1].
    assert CacheStats(l1_hits=4, l1_misses=0, l2_hits=8).hit_rate() == 1.0
    assert CacheStats(l1_hits=2, l1_misses=2, l2_hits=1, l2_misses=1, l3_reads=1).hit_rate() == 0.75
    assert CacheStats(l2_hits=0, l2_misses=4, l3_reads=4).hit_rate() == 0.0
