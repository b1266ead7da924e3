"""The block-wise train/val split: exact counts, every sample in one split, any slice drawn from its blocks
alone equal to the same slice of the whole, and small sets split as one seeded permutation of all samples."""

from __future__ import annotations

import numpy as np
import pytest

from cs3ray.data import split as split_mod
from cs3ray.data.split import Split


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(split_mod, "BLOCK", 1000)  # many blocks from a test-sized set


def whole(s: Split, name: str) -> np.ndarray:
    return np.concatenate([s._block(name, b) for b in range(len(s._bounds) - 1)])


@pytest.mark.parametrize(("n", "n_val"), [(10_500, 105), (3_001, 1), (7_000, 3_500), (999, 10)])
def test_splits_are_exact_disjoint_and_sorted(small_blocks, n, n_val):
    s = Split(n, n_val, seed=7)
    val, train = s.ids("val"), s.ids("train")
    assert len(val) == n_val and len(train) == n - n_val
    assert np.array_equal(np.sort(np.concatenate([val, train])), np.arange(n))  # every sample, once
    assert np.all(np.diff(val) > 0) and np.all(np.diff(train) > 0)
    assert np.array_equal(val, whole(s, "val"))


def test_validation_is_spread_over_every_block(small_blocks):
    val = Split(20_000, 2_000, seed=1).ids("val")
    per_block = np.bincount(val // 1000, minlength=20)
    assert per_block.min() == per_block.max() == 100  # each block its exact share, not the first ones


def test_any_slice_equals_that_slice_of_the_whole(small_blocks):
    s = Split(10_500, 1_234, seed=3)
    for name in ("val", "train"):
        full = s.ids(name)
        for start, stop in [(0, 1), (0, len(full)), (5, 999), (990, 2_011), (len(full) - 3, len(full) + 50),
                            (400, 400), (123, 9_000)]:
            assert np.array_equal(s.ids(name, start, stop), full[start:stop]), (name, start, stop)


def test_a_slice_touches_only_its_blocks(small_blocks, monkeypatch):
    s = Split(50_000, 500, seed=0)
    drawn: list[int] = []
    real = Split._block
    monkeypatch.setattr(Split, "_block", lambda self, name, b: drawn.append(b) or real(self, name, b))
    s.ids("train", 20_000, 20_500)
    assert len(drawn) <= 2  # 500 positions lie in at most two blocks of 1,000, whatever n is


def test_a_set_of_one_block_is_one_seeded_permutation_of_all_samples():
    n, n_val = 5_000, 50
    order = np.random.default_rng(11).permutation(n)
    s = Split(n, n_val, seed=11)
    assert np.array_equal(s.ids("val"), np.sort(order[:n_val]))
    assert np.array_equal(s.ids("train"), np.sort(order[n_val:]))


def test_counts_of_billions_of_samples_do_not_overflow():
    s = Split(12_000_000_000, 120_000_000, seed=0)
    assert s._val_before[-1] == 120_000_000 and np.all(np.diff(s._val_before) >= 0)
    assert len(s.ids("val", 119_999_990, 120_000_010)) == 10
