"""Load balancing's pure parts: shares in proportion to speed, re-split only when persistently uneven, and the
stream's re-split micro-batches covering exactly the samples of the equal split, in the same global order."""

from __future__ import annotations

import pytest

from cs3ray.data.stream import TrainStream
from cs3ray.train.balance import Balancer, split_shares, step_time

from helpers.shard_sets import make_shard_set


def test_shares_follow_the_rates_and_add_up():
    assert split_shares(16, [1.0, 1.0]) == [8, 8]
    assert split_shares(16, [2.0, 1.0]) == [11, 5]  # 10.67 and 5.33: the larger remainder gets the row
    assert split_shares(12, [1.0, 1.0, 1.0, 3.0]) == [2, 2, 2, 6]
    assert split_shares(4, [100.0, 0.001]) == [3, 1]  # every rank keeps at least one row
    assert split_shares(5, [0.0, 0.0]) == [3, 2]
    with pytest.raises(ValueError, match="cannot give 3 ranks 2 each"):
        split_shares(5, [1, 1, 1], minimum=2)
    assert step_time([11, 5], [2.0, 1.0]) == 5.5 < step_time([8, 8], [2.0, 1.0]) == 8.0


def test_balancer_moves_only_when_persistently_uneven():
    b = Balancer([8, 8])
    assert b.observe([1.0, 1.02], [8, 8]) is None  # within the threshold: noise
    assert b.observe([1.0, 2.0], [8, 8]) is None  # once is not persistent
    assert b.observe([1.0, 1.0], [8, 8]) is None  # and the vote resets
    assert b.observe([1.0, 2.0], [8, 8]) is None
    assert b.observe([1.0, 2.0], [8, 8]) == [11, 5]
    assert b.shares == [11, 5]
    # Balanced now (rank 1 is half as fast and has half the rows... within rounding): nothing moves.
    assert b.observe([5.5, 5.0], [11, 5]) is None and b.observe([5.5, 5.0], [11, 5]) is None


def test_resplit_stream_covers_the_same_samples_in_the_same_order(tmp_path):
    src, _ = make_shard_set(tmp_path / "l3", n_shards=2)
    l2, world, batch = str(tmp_path / "l2"), 2, 4

    def streams():
        return [TrainStream(batch, 11, None, shards_url=src, cache={"disk_dir": l2}, rank=r, world=world)
                for r in range(world)]

    equal, split = streams(), streams()
    for s in split:
        s.reshare([6, 2])
    for _ in range(3):
        a = [next(s) for s in equal]
        b = [next(s) for s in split]
        assert [len(x) for x in b] == [6, 2]
        # The ranks' rows in rank order are the micro-batch in global order, split or not.
        assert [row.tolist() for x in a for row in x] == [row.tolist() for x in b for row in x]
    assert [s.position for s in split] == [s.position for s in equal] == [3 * world * batch] * world
    with pytest.raises(ValueError, match="must give each of 2 ranks at least one row and add up to 8"):
        split[0].reshare([8, 0])
    split[0].reshare([4, 4])
    assert split[0].shares is None  # equal shares are the plain split
    for s in equal + split:
        s.close()
