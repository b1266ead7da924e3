"""The train/val split of a shard set, drawn block by block so that no process ever holds every sample's id.

The samples 0..n-1 are cut into blocks of BLOCK. Block b holds its share of the validation samples,
`floor(n_val * end_b / n) - floor(n_val * start_b / n)` (the shares add up to n_val exactly), drawn from
a permutation of the block seeded by (seed, b). A split's sorted ids are then the blocks' picks in block
order, so the ids at any positions [start, stop) of a split come from the few blocks those positions
fall in: a shard writer draws only those, in O(BLOCK) memory, whatever the corpus size.

Block 0 is seeded by the seed alone, so a set of at most BLOCK samples is split as one seeded
permutation of all its samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

BLOCK = 1 << 20  # samples per block: 8 MiB of ids to draw one
SPLITS = ("val", "train")


@dataclass(frozen=True)
class Split:
    """The split of n samples, n_val of them validation, drawn with `seed`."""

    n: int
    n_val: int
    seed: int

    @cached_property
    def _bounds(self) -> np.ndarray:
        """Sample id where each block starts, and n at the end (a few integers per million samples)."""
        return np.append(np.arange(0, self.n, BLOCK, dtype=np.int64), self.n)

    @cached_property
    def _val_before(self) -> np.ndarray:
        """Validation samples in the blocks before each block boundary."""
        # Python integers: n_val * n overflows int64 past a few billion samples.
        return np.array([self.n_val * int(b) // self.n for b in self._bounds], dtype=np.int64)

    def count(self, split: str) -> int:
        return self.n_val if split == "val" else self.n - self.n_val

    def _before(self, split: str) -> np.ndarray:
        return self._val_before if split == "val" else self._bounds - self._val_before

    def _block(self, split: str, b: int) -> np.ndarray:
        """Block b's sorted ids of `split`."""
        lo, hi = int(self._bounds[b]), int(self._bounds[b + 1])
        rng = np.random.default_rng(self.seed if b == 0 else [self.seed, b])
        picked = rng.permutation(hi - lo)[: int(self._val_before[b + 1] - self._val_before[b])]
        in_val = np.zeros(hi - lo, dtype=bool)
        in_val[picked] = True
        return lo + np.flatnonzero(in_val if split == "val" else ~in_val)

    def ids(self, split: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The ids at positions [start, stop) of `split`'s sorted ids."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}'")
        stop = self.count(split) if stop is None else min(stop, self.count(split))
        if start >= stop:
            return np.zeros(0, dtype=np.int64)
        before = self._before(split)
        first = int(np.searchsorted(before, start, side="right")) - 1
        last = int(np.searchsorted(before, stop, side="left")) - 1
        parts = [self._block(split, b) for b in range(first, last + 1)]
        ids = np.concatenate(parts)
        offset = start - int(before[first])
        return ids[offset: offset + stop - start]
