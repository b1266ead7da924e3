"""`data.transform` functions for tests: each leaves a file named after the process it ran in."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

PIDS = Path(tempfile.gettempdir()) / "cs3-test-transform-pids"


def _mark() -> None:
    PIDS.mkdir(parents=True, exist_ok=True)
    (PIDS / str(os.getpid())).touch()


def record_pid(batch: dict) -> dict:
    """The identity, noting where it ran."""
    _mark()
    return batch


def shift(batch: dict) -> dict:
    """Every token id + 1 (wrapping within 256), noting where it ran."""
    _mark()
    return {"tokens": (np.asarray(batch["tokens"]) + 1) % 256}


def wrong_shape(batch: dict) -> dict:
    return {"tokens": np.asarray(batch["tokens"])[:, :-1]}
