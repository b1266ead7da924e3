"""The data trace (`cache.trace`): the sample ids each rank trained on, step by step, and an audit of them.

A rank writes one small file per completed optimizer step, holding the ids of every sample
its micro-batches of that step contained, under <run dir>/data-trace/. A step is traced
once it has completed (its gradients were averaged), so a step cut short by a failure
leaves no record, and a step redone after a restore leaves a second one: each file also
carries a random tag of the stream that wrote it, so no attempt overwrites another. Off by
default, and then nothing is collected.

`audit` compares what a run trained on with the exact global order it should have followed.
"""

from __future__ import annotations

import io
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cs3ray.storage import Storage


class TraceWriter:
    """Collects the ids a rank draws and writes them per completed step."""

    def __init__(self, folder: Storage) -> None:
        self.folder = folder
        self.tag = uuid.uuid4().hex[:8]  # this stream's: a redone step gets a file of its own
        self.pending: list[np.ndarray] = []

    def add(self, ids: np.ndarray) -> None:
        """Ids of one micro-batch just drawn (not yet trained on)."""
        self.pending.append(ids)

    def drop(self) -> None:
        """Forget what was drawn since the last completed step (the step will not complete)."""
        self.pending = []

    def step(self, step: int, rank: int, world: int, write: bool = True) -> None:
        """The step completed: write what was drawn for it (unless `write` is False) and start over."""
        ids, self.pending = self.pending, []
        if not write:
            return
        buf = io.BytesIO()
        np.save(buf, np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64))
        self.folder.write_bytes(buf.getvalue(), f"step-{step:08d}-rank-{rank:03d}-of-{world:03d}-{self.tag}.npy",
                                durable=False)


def read_trace(folder: Storage) -> np.ndarray:
    """Every sample id traced under `folder`, one entry per time a sample was trained on."""
    files = [name for name in folder.ls() if name.endswith(".npy")]
    parts = [np.load(io.BytesIO(folder.read_bytes(name))) for name in files]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Audit:
    """What a run trained on against the first `expected` samples of the global order."""

    expected: int
    trained: int
    repeated: int    # trainings of a sample beyond what the order asks for (a sample trained twice: 1)
    skipped: int     # trainings the order asks for that never happened
    unexpected: int  # samples trained that the order's first `expected` do not hold (ahead of it, say)

    @property
    def exact(self) -> bool:
        return self.repeated == 0 and self.skipped == 0 and self.unexpected == 0


def audit(trained: Iterable[int] | np.ndarray, expected: Iterable[int] | np.ndarray) -> Audit:
    """Compare the traced ids with the order's first samples (`order.ids(0, n)`).

    As multisets, not sequences: ranks write their steps independently, and past one epoch
    the order itself holds every id more than once. A run whose data position jumped ahead
    shows as skipped plus unexpected samples, one restored from an older position as repeats.
    """
    got = Counter(np.asarray(trained, dtype=np.int64).tolist())
    want = Counter(np.asarray(expected, dtype=np.int64).tolist())
    repeated = sum(max(0, n - max(want[i], 1)) for i, n in got.items())
    unexpected = sum(1 for i in got if want[i] == 0)
    skipped = sum((want - got).values())
    return Audit(expected=sum(want.values()), trained=sum(got.values()), repeated=repeated, skipped=skipped,
                 unexpected=unexpected)
