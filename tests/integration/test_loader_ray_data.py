"""`data.loader: ray_data` against `direct`: the same micro-batches, rank by rank, across a 2 -> 1 -> 2 resize
through checkpoint positions; `data.transform` runs in Ray Data tasks, not in the consuming process, as a
map_batches stage; both stages declare CPU and memory that Ray assigns them; a task process decodes each shard
once, the manifest is not in any task, and rows are a fixed-shape uint16 column that converts without a copy."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
from ray import cloudpickle

from cs3ray.data.corpus import DataError
from cs3ray.data.ray_stream import DEFAULT_CPUS, RayDataStream, decodes
from cs3ray.data.shards import read_manifest
from cs3ray.data.stream import DEFAULT_WINDOW, GlobalOrder, TrainStream
from cs3ray.data.trace import audit, read_trace
from cs3ray.errors import UserError
from cs3ray.storage import open_url

from helpers.shard_sets import make_shard_set
from helpers.transforms import PIDS, RESOURCES

BATCH, SEED = 4, 11


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    return make_shard_set(tmp_path_factory.mktemp("loader") / "shards", n_shards=6, samples_per_shard=32,
                          seq_len=16)[0]


def _steps(cls, url, cache, world, steps, position=None, transform=None, trace=None, first_step=0):
    """`steps` micro-batches of each of `world` ranks: (the batches of each step, the position after them).
    With `trace`, each rank traces the sample ids of every step there (as training does)."""
    streams = [cls(BATCH, SEED, position, shards_url=url, cache=cache, rank=r, world=world, transform=transform,
                   trace_url=trace) for r in range(world)]
    try:
        batches = []
        for step in range(first_step + 1, first_step + steps + 1):
            batches.append([next(s) for s in streams])
            for s in streams:
                s.trace_step(step)
        return batches, streams[0].state()
    finally:
        for s in streams:
            s.close()


def test_both_loaders_give_the_same_batches_and_traced_ids_across_a_2_1_2_resize(ray_client, shard_set, tmp_path):
    runs = {}
    for loader, cls in (("direct", TrainStream), ("ray_data", RayDataStream)):
        cache = {"disk_dir": str(tmp_path / loader)}  # each loader fills its own node cache from L3
        trace = str(tmp_path / f"trace-{loader}")
        position, got, done = None, [], 0
        for world, steps in ((2, 5), (1, 7), (2, 4)):  # 76 samples: crosses shard windows and the resizes
            batches, position = _steps(cls, shard_set, cache, world, steps, position, trace=trace, first_step=done)
            got.append(batches)
            done += steps
        runs[loader] = (got, position, read_trace(open_url(trace)))
    (direct, end_direct, ids_direct), (ray_data, end_ray, ids_ray) = runs["direct"], runs["ray_data"]
    consumed = (5 * 2 + 7 + 4 * 2) * BATCH
    assert end_direct == end_ray and end_direct["samples"] == consumed
    for leg_d, leg_r in zip(direct, ray_data, strict=True):
        for step_d, step_r in zip(leg_d, leg_r, strict=True):
            for a, b in zip(step_d, step_r, strict=True):
                np.testing.assert_array_equal(a, b)
    # The traced ids: the same multiset from both, and exactly the global order's first samples.
    np.testing.assert_array_equal(np.sort(ids_direct), np.sort(ids_ray))
    order = GlobalOrder(read_manifest(open_url(shard_set))["splits"]["train"], SEED, DEFAULT_WINDOW)
    assert audit(ids_ray, order.ids(0, consumed)).exact


def test_transform_runs_in_ray_data_tasks_and_a_bad_one_is_one_clear_error(ray_client, shard_set, tmp_path):
    shutil.rmtree(PIDS, ignore_errors=True)
    cache = {"disk_dir": str(tmp_path / "l2")}
    plain, _ = _steps(TrainStream, shard_set, cache, 1, 3)
    shifted, _ = _steps(RayDataStream, shard_set, cache, 1, 3, transform="tests.helpers.transforms:shift")
    for (a,), (b,) in zip(plain, shifted, strict=True):
        np.testing.assert_array_equal(b, (a + 1) % 256)
    pids = {int(p.name) for p in PIDS.iterdir()}
    assert pids and os.getpid() not in pids  # applied in Ray Data's task processes, not in the consumer

    with pytest.raises(UserError, match="data.transform 'tests.helpers.transforms:missing' cannot be imported"):
        RayDataStream(BATCH, SEED, shards_url=shard_set, cache=cache, transform="tests.helpers.transforms:missing")
    stream = TrainStream(BATCH, SEED, shards_url=shard_set, cache=cache, transform="tests.helpers.transforms:wrong_shape")
    with pytest.raises(DataError, match=r"must return \{'tokens': integer array of shape \(4, 17\)\}"):
        next(stream)
    stream.close()


def test_both_stages_declare_cpu_and_memory_that_ray_assigns_them(ray_client, shard_set, tmp_path):
    shutil.rmtree(RESOURCES, ignore_errors=True)
    stream = RayDataStream(BATCH, SEED, shards_url=shard_set, cache={"disk_dir": str(tmp_path / "l2")},
                           transform="tests.helpers.transforms:record_resources")
    try:
        declared = stream.resources()
        # At least the decoded shards' budget (cache.memory_bytes, 256 MiB by default), plus the task's blocks.
        assert declared["num_cpus"] == DEFAULT_CPUS and declared["memory"] > 256 * 2**20
        ds = stream.dataset(8)
        transform, (read,) = ds._logical_plan.dag, ds._logical_plan.dag.input_dependencies
        assert transform.name == "MapBatches(_apply_transform)" and read.name == "ReadRankSlice"
        for stage in (read, transform):
            assert {k: stage.ray_remote_args[k] for k in ("num_cpus", "memory")} == declared
        for _ in range(3):
            next(stream)
    finally:
        stream.close()
    assigned = [json.loads(p.read_text()) for p in RESOURCES.iterdir()]
    assert assigned and all(a == {"CPU": declared["num_cpus"], "memory": declared["memory"]} for a in assigned)
    # Ray Data executed the transform as its own map_batches operator (fused into the read task or not).
    stats = ds.materialize().stats()
    assert "MapBatches(_apply_transform)" in stats and "ReadRankSlice" in stats


def test_a_process_decodes_each_shard_once_and_rows_are_fixed_size_uint16(ray_client, shard_set, tmp_path):
    stream = RayDataStream(BATCH, SEED, shards_url=shard_set, cache={"disk_dir": str(tmp_path / "l2")})
    try:
        tasks = stream.dataset(16)._logical_plan.dag.datasource.get_read_tasks(1)
        # The manifest travels by reference: no task carries a shard's name.
        entries = read_manifest(open_url(shard_set))["splits"]["train"]
        assert len(tasks) == 4 and all(entries[0]["file"].encode() not in cloudpickle.dumps(t) for t in tasks)
        before = decodes()
        per_task = [list(task()) for task in tasks]  # every task of the pipeline, in this one process
        blocks = [b for task in per_task for b in task]
        order = GlobalOrder(entries, SEED, DEFAULT_WINDOW)
        ids = np.concatenate([b.column("ids").to_numpy() for b in blocks])
        np.testing.assert_array_equal(ids, order.ids(0, 16 * BATCH))
        shards = np.unique(order.locate(ids)[0])
        needed = sum(len(np.unique(order.locate(np.concatenate([b.column("ids").to_numpy() for b in t]))[0]))
                     for t in per_task)
        assert decodes() - before == len(shards) < needed  # each shard decoded once, not once per task needing it

        tokens = blocks[0].column("tokens")
        assert isinstance(tokens.type, pa.FixedShapeTensorType) and tokens.type.value_type == pa.uint16()
        assert tokens.type.storage_type == pa.list_(pa.uint16(), 17)  # seq_len 16 + 1, fixed size
        chunk = tokens.chunk(0)
        rows = chunk.to_numpy_ndarray()
        assert rows.shape == (BATCH, 17) and rows.dtype == np.uint16
        assert rows.ctypes.data == chunk.storage.values.buffers()[1].address  # the same memory: no copy
        batch = stream.dataset(1).take_batch(BATCH, batch_format="numpy")  # and so does Ray Data's numpy batch
        assert batch["tokens"].dtype == np.uint16 and batch["tokens"].shape == (BATCH, 17)
    finally:
        stream.close()
