"""The cache over a real S3-protocol endpoint (moto server) behind a latency/outage proxy, and through Ray Data."""

from __future__ import annotations

import json
import threading

import pytest

from cs3ray.bench.loopback_s3 import LatencyProxy, MotoServer, make_bucket, s3_options
from cs3ray.data.cache import CacheError, TieredCache, read_all, total
from cs3ray.storage import open_url

from conftest import run_cs3
from helpers.shard_sets import make_shard_set


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(proxy, storage options through the proxy, shard URL, manifest): shards on moto behind a proxy."""
    moto = MotoServer()
    make_bucket(moto.url, "cs3")
    url, manifest = make_shard_set(tmp_path_factory.mktemp("s3") / "shards", n_shards=6, url="s3://cs3/shards",
                                   options=s3_options(moto.url))
    proxy = LatencyProxy(moto.url, latency_s=0.005)
    yield proxy, s3_options(proxy.url), url, manifest
    proxy.stop()
    moto.stop()


def test_reads_through_s3_then_from_l2(s3, tmp_path):
    proxy, options, url, manifest = s3
    entries = manifest["splits"]["train"]
    with TieredCache(open_url(url, options), entries, memory_bytes=0, disk_dir=str(tmp_path)) as c:
        first = [c.get(e["file"]) for e in entries]
        assert c.stats.l3_reads == len(entries)
        before = proxy.requests
        assert [c.get(e["file"]) for e in entries] == first
        assert proxy.requests == before and c.stats.l2_hits == len(entries)


def _one_request_per_attempt(options: dict) -> dict:
    # botocore's own retries off, so each 503 reaches the cache's retry (they would hide or stretch it); its
    # `max_attempts` counts retries, `total_max_attempts` the first request too.
    return {**options, "config_kwargs": {"retries": {"total_max_attempts": 1}}}


def test_outage_of_a_few_seconds_is_ridden_out(s3, tmp_path):
    proxy, options, url, manifest = s3
    entries = manifest["splits"]["train"]
    with TieredCache(open_url(url, _one_request_per_attempt(options)), entries, memory_bytes=0,
                     disk_dir=str(tmp_path), retry_deadline_s=60) as c:
        proxy.down = True
        threading.Timer(3.0, lambda: setattr(proxy, "down", False)).start()
        data = c.get(entries[0]["file"])
        # The read met the outage and retried through it: a read the outage missed has no retries.
        assert len(data) == entries[0]["bytes"] and c.stats.l3_retries >= 1
        assert c.stats.l3_reads == 1


def test_outage_past_the_deadline_is_one_clear_error(s3, tmp_path, retry_clock):
    proxy, options, url, manifest = s3
    entries = manifest["splits"]["train"]
    proxy.down = True
    try:
        with TieredCache(open_url(url, _one_request_per_attempt(options)), entries, memory_bytes=0,
                         disk_dir=str(tmp_path), retry_deadline_s=2) as c:
            with pytest.raises(CacheError, match=f"could not read shard '{url}/{entries[1]['file']}' within 2s"):
                c.get(entries[1]["file"])
            # Retried with backoff until the cache's 2 s deadline, then stopped: a wait after each failed
            # attempt, the waits adding up to the deadline.
            waits = retry_clock.waits
            assert c.stats.l3_retries == len(waits) >= 2 and sum(waits) == pytest.approx(2)
    finally:
        proxy.down = False


def test_ray_data_reads_through_each_nodes_cache(s3, tmp_path, ray_client):
    from cs3ray.data.stream import train_dataset

    proxy, options, url, manifest = s3
    cache = {"disk_dir": str(tmp_path / "l2"), "memory_bytes": 0}
    ds = train_dataset(open_url(url, options), manifest, seed=0, cache=cache)
    for _ in range(2):
        assert ds.count() == manifest["samples"]["train"]
        rows = sum(len(b["tokens"]) for b in ds.iter_batches(batch_size=None, batch_format="numpy"))
        assert rows == manifest["samples"]["train"]
    s = total(read_all(str(tmp_path / "l2")))
    assert s.l3_reads == len(manifest["splits"]["train"])  # later passes hit the node's L2
    assert s.l2_hits >= len(manifest["splits"]["train"])


def test_cli_warm_and_stats(s3, tmp_path):
    proxy, options, url, manifest = s3
    over = [f"cache.disk_dir={tmp_path}", f"storage.options={json.dumps(options)}"]
    r = run_cs3(["cache", "warm", url, *over, "--json"], check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cached_shards"] == out["shards"] == len(manifest["splits"]["train"])
    r = run_cs3(["cache", "stats", *over, "--json"], check=True)
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["disk_files"] == out["shards"] and stats["l3_reads"] == out["shards"]
    r = run_cs3(["cache", "warm", "s3://cs3/nothing-here", *over])
    assert r.returncode == 2 and "manifest.json" in r.stderr and "Traceback" not in r.stderr
