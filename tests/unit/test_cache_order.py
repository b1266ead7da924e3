"""The global sample order and the stream's position arithmetic (no Ray: ranks are simulated)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from cs3ray.data.corpus import DataError
from cs3ray.data.shards import decode_tokens
from cs3ray.data.stream import GlobalOrder, TrainStream, decode_shard
from cs3ray.storage import open_url

from helpers.shard_sets import make_shard_set


def entries(counts):
    return [{"file": f"s{i}", "samples": c} for i, c in enumerate(counts)]


def test_each_epoch_is_a_permutation_and_a_function_of_seed_and_epoch():
    o = GlobalOrder(entries([30, 30, 30, 17, 5]), seed=7, window=2)
    e0, e1 = o.epoch(0)[0], o.epoch(1)[0]
    assert sorted(e0) == list(range(o.total)) == sorted(e1)
    assert not np.array_equal(e0, e1)
    assert np.array_equal(GlobalOrder(entries([30, 30, 30, 17, 5]), 7, 2).epoch(1)[0], e1)
    assert not np.array_equal(GlobalOrder(entries([30, 30, 30, 17, 5]), 8, 2).epoch(0)[0], e0)
    # ids() runs on across the epoch boundary without a gap
    assert np.array_equal(o.ids(o.total - 3, o.total + 4), np.concatenate([e0[-3:], e1[:4]]))


def test_windows_keep_a_batch_within_few_shards():
    o = GlobalOrder(entries([40] * 8), seed=0, window=2)
    shard, _ = o.locate(o.ids(0, 40))
    assert len(np.unique(shard)) <= 2


def _simulate(src, l2, world, steps, accum, batch, position=None):
    """Ranks in lockstep, as DDP runs them; returns (sample ids seen, position after)."""
    streams = [TrainStream(batch, 11, position, shards_url=src, cache={"disk_dir": l2, "shuffle_window": 2},
                           rank=r, world=world, trace_url=None) for r in range(world)]
    seen = []
    for _ in range(steps * accum):
        for s in streams:
            start = s.position + s.rank * batch
            seen.extend(s.order.ids(start, start + batch).tolist())
            next(s)
    states = [s.state() for s in streams]
    assert all(st == states[0] for st in states)
    for s in streams:
        s.close()
    return seen, states[0]


@pytest.mark.parametrize("world_a,world_b,accum", [(2, 1, 1), (1, 3, 2), (3, 2, 1)])
def test_resume_with_another_world_size_sees_one_uninterrupted_pass(tmp_path, world_a, world_b, accum):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=2)
    l2, batch = str(tmp_path / "l2"), 8
    a, pos = _simulate(src, l2, world_a, 5, accum, batch)
    b, end = _simulate(src, l2, world_b, 9, accum, batch, pos)
    assert end["samples"] == (world_a * 5 + world_b * 9) * accum * batch
    order = GlobalOrder(manifest["splits"]["train"], 11, 2)
    assert collections.Counter(a + b) == collections.Counter(order.ids(0, end["samples"]).tolist())
    assert end["samples"] > order.total  # the run crossed an epoch boundary


def test_batches_hold_the_samples_of_the_order(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=3)
    shards = open_url(src)
    rows = {}
    for e in manifest["splits"]["train"]:
        import io

        import pyarrow.parquet as pq

        col = pq.read_table(io.BytesIO(shards.read_bytes(e["file"]))).column("tokens").to_pylist()
        for t in decode_tokens(col):
            rows[len(rows)] = t
        assert np.array_equal(decode_shard(shards.read_bytes(e["file"])), decode_tokens(col))
    s = TrainStream(5, 3, None, shards_url=src, cache={"disk_dir": str(tmp_path / "l2")}, rank=1, world=2)
    for _ in range(4):
        ids = s.order.ids(s.position + 5, s.position + 10)
        batch = next(s)
        assert batch.dtype == np.int64 and np.array_equal(batch, np.stack([rows[i] for i in ids]))
    s.close()


def test_resume_refuses_a_position_of_another_order(tmp_path):
    src, _ = make_shard_set(tmp_path / "l3", n_shards=2)
    s = TrainStream(2, 1, None, shards_url=src, cache={"disk_dir": str(tmp_path / "l2")})
    next(s)
    pos = s.state()
    s.close()
    with pytest.raises(DataError, match="train.seed"):
        TrainStream(2, 2, pos, shards_url=src, cache={"disk_dir": str(tmp_path / "l2")})
    legacy = TrainStream(2, 1, {"samples": 64, "epoch": 0}, shards_url=src, cache={"disk_dir": str(tmp_path / "l2")})
    assert legacy.position == 0
    legacy.close()


def test_replicas_resplit_each_global_batch_over_those_alive(tmp_path):
    """Fault-tolerant replicas: 2 -> 1 -> 2 participants, and a step redone after a failure."""
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=2)
    cache = {"disk_dir": str(tmp_path / "l2"), "shuffle_window": 2}
    streams = [TrainStream(4, 11, None, shards_url=src, cache=cache, rank=r, world=2) for r in range(2)]
    per_step, seen = 8, []
    for alive, accum, redo in [((0, 1), 1, False), ((0,), 2, True), ((0,), 2, False), ((1, 0), 1, False)]:
        start = streams[alive[0]].position
        batch = per_step // (len(alive) * accum)
        step = []
        for rank, i in enumerate(alive):
            s = streams[i]
            s.seek(start, rank, len(alive), batch)
            for _ in range(accum):
                first = s.position + s.rank * batch
                step.extend(s.order.ids(first, first + batch).tolist())
                next(s)
        if not redo:  # a failed step is thrown away: the next one takes its samples again
            seen.extend(step)
        for s in streams:
            s.seek(start + (0 if redo else per_step), s.rank, s.world, s.batch_size)
    order = GlobalOrder(manifest["splits"]["train"], 11, 2)
    assert sorted(seen) == sorted(order.ids(0, 3 * per_step).tolist()) and len(seen) == 3 * per_step
    for s in streams:
        s.close()
