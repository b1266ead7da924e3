"""Micro-batches from a user's own Ray Dataset (`train(cfg, dataset=ds)`), under Ray Train's semantics.

Ray Train hands each worker a `streaming_split` shard of the dataset: blocks go to whichever worker
asks first, so which rows a rank sees, and where an interrupted epoch stood, is not recorded
anywhere (ray issues 37633 and 48224). A resume, a retry after a failure or an elastic resize
therefore starts the dataset's epoch over: the run keeps its step count, model and optimizer, but
sees the epoch's first rows again. The exact, resumable alternative is a shard set (`data.source`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np

from .corpus import DataError

log = logging.getLogger(__name__)
SOURCE = "dataset"
RESTART_WARNING = ("a run fed by a Ray Dataset (train(cfg, dataset=...)) cannot continue an epoch where it "
                   "stopped: Ray Data does not record which rows each worker read, so the dataset's epoch starts over")


def check_rows(tokens: Any, rows: int | None, width: int, vocab_size: int, what: str) -> np.ndarray:
    """`tokens` as a (rows, width) int64 array of ids below vocab_size, or one DataError naming the problem."""
    try:
        arr = np.asarray(tokens)
        if arr.dtype == object:  # rows of unequal length arrive as an array of arrays
            arr = np.stack(list(arr))
    except ValueError:
        raise DataError(f"{what}: the 'tokens' rows are not all {width} tokens long (train.seq_len + 1).") from None
    if arr.ndim != 2 or arr.shape[1] != width or (rows is not None and arr.shape[0] != rows):
        raise DataError(f"{what}: 'tokens' rows of {arr.shape[1:] or 'no'} tokens, expected {width} "
                        f"(train.seq_len + 1) per row.")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{what}: 'tokens' holds {arr.dtype} values, not integer token ids.")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise DataError(f"{what}: token id {int(arr.max() if arr.max() >= vocab_size else arr.min())} is outside "
                        f"model.vocab_size={vocab_size}.")
    return arr.astype(np.int64, copy=False)


class DatasetStream:
    """This worker's micro-batches of its Ray Train dataset shard, epoch after epoch (same interface as
    TrainStream; `position` counts samples, it cannot say which)."""

    def __init__(self, shard: Any, batch_size: int, width: int, vocab_size: int,
                 position: dict[str, Any] | None = None, world: int = 1) -> None:
        self.shard, self.batch_size, self.width, self.vocab_size, self.world = shard, batch_size, width, vocab_size, world
        if position:
            log.warning("%s (resuming at %s samples).", RESTART_WARNING, position.get("samples"))
        self.base = int((position or {}).get("samples", 0))
        self.consumed, self.epoch = 0, 0
        self._batches: Iterator[dict] | None = None
        self._epoch_batches = 0

    @property
    def position(self) -> int:
        return self.base + self.consumed * self.world * self.batch_size

    def __iter__(self) -> "DatasetStream":
        return self

    def __next__(self) -> np.ndarray:
        while True:
            if self._batches is None:
                self._batches = iter(self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                                            drop_last=True))
                self._epoch_batches = 0
            try:
                batch = next(self._batches)
                break
            except StopIteration:
                if self._epoch_batches == 0:
                    raise DataError(f"this worker's share of the dataset holds fewer than train.batch_size="
                                    f"{self.batch_size} rows; use a larger dataset or smaller batches.") from None
                self._batches, self.epoch = None, self.epoch + 1
        if "tokens" not in batch:
            raise DataError(f"the dataset has no 'tokens' column (it has {', '.join(batch) or 'none'}).")
        self._epoch_batches += 1
        self.consumed += 1
        return check_rows(batch["tokens"], self.batch_size, self.width, self.vocab_size, "the training dataset")

    def seek(self, samples: int, *args: Any) -> None:
        """Fault-tolerant replicas re-split each step by the global order, which a Ray Dataset has not."""
        raise DataError("a run fed by a Ray Dataset cannot move to another data position "
                        "(cluster.fault_tolerance=replicas needs a shard set).")

    def state(self) -> dict[str, Any]:
        return {"source": SOURCE, "samples": self.position, "epoch": self.epoch, "world_size": self.world}

    def trace_step(self, step: int, write: bool = True) -> None:
        """Rows of a user's dataset carry no sample ids: nothing to trace."""

    def cache_counters(self) -> dict[str, Any] | None:
        """None: a user's dataset is not read through the shard cache."""
        return None

    def close(self) -> None:
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()
