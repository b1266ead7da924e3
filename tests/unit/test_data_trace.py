"""The data trace (`cache.trace`) and its audit against the global order: what `cs3 bench recovery` counts."""

from __future__ import annotations

import numpy as np

from cs3ray.data.stream import GlobalOrder, TrainStream
from cs3ray.data.trace import audit, read_trace
from cs3ray.storage import open_url

from helpers.shard_sets import make_shard_set


def _order() -> GlobalOrder:
    return GlobalOrder([{"file": f"s{i}", "samples": c} for i, c in enumerate([50, 50, 27])], seed=5, window=2)


def _ranks(order: GlobalOrder, start: int, stop: int, world: int = 2) -> list[np.ndarray]:
    """One step file per rank per step of 8 samples each, as the ranks of a group write them (any order)."""
    steps = [order.ids(p, p + 8 * world) for p in range(start, stop, 8 * world)]
    return [ids[r * 8:(r + 1) * 8] for ids in reversed(steps) for r in range(world)]


def test_audit_exact_repeat_and_skip_on_synthetic_traces():
    order = _order()
    expected = order.ids(0, 64)
    exact = audit(np.concatenate(_ranks(order, 0, 64)), expected)
    assert exact.exact and (exact.trained, exact.expected) == (64, 64)

    # A restart from the snapshot at sample 32 after training up to 48: samples 32-47 trained twice.
    redone = audit(np.concatenate(_ranks(order, 0, 48) + _ranks(order, 32, 64)), expected)
    assert (redone.repeated, redone.skipped, redone.unexpected) == (16, 0, 0)

    # A position restored one step ahead of its snapshot: 16 samples never trained, 16 past the end instead.
    ahead = audit(np.concatenate(_ranks(order, 0, 32) + _ranks(order, 48, 80)), expected)
    assert (ahead.repeated, ahead.skipped, ahead.unexpected) == (0, 16, 16)

    # Past one epoch (127 samples) the order itself holds ids twice: not repeats.
    long = order.ids(0, 180)
    assert len(set(long.tolist())) < 180 and audit(long[::-1], long).exact
    assert audit(np.concatenate([long, long[:5]]), long).repeated == 5


def test_stream_traces_completed_steps_only(tmp_path):
    src, manifest = make_shard_set(tmp_path / "l3", n_shards=3)
    cache = {"disk_dir": str(tmp_path / "l2"), "shuffle_window": 2}
    trace = tmp_path / "trace"
    order = GlobalOrder(manifest["splits"]["train"], 11, 2)

    def steps(position, first: int, last: int, fail_at: int | None = None) -> dict:
        """Two ranks in lockstep, 2 micro-batches of 4 a step; a step `fail_at` is cut short once and redone."""
        streams = [TrainStream(4, 11, position, shards_url=src, cache=cache, rank=r, world=2,
                               trace_url=str(trace)) for r in range(2)]
        for step in range(first, last + 1):
            start = streams[0].position
            for s in streams:
                next(s), next(s)
            if step == fail_at:  # a replica died mid-step: every survivor goes back to the step's start
                for s in streams:
                    s.seek(start)
                    next(s), next(s)
            for s in streams:
                s.trace_step(step)
        state = streams[0].state()
        for s in streams:
            s.close()
        return state

    after4 = steps(None, 1, 4, fail_at=3)
    steps(after4, 5, 6)
    assert len(list(trace.iterdir())) == 6 * 2  # one file per rank and completed step
    assert audit(read_trace(open_url(str(trace))), order.ids(0, 6 * 16)).exact

    # A restart from the snapshot after step 4 that had trained up to step 6: steps 5-6 come twice.
    steps(after4, 5, 6)
    assert audit(read_trace(open_url(str(trace))), order.ids(0, 6 * 16)).repeated == 2 * 16
