"""`data.transform` functions for tests: each leaves a file named after the process it ran in."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

PIDS = Path(tempfile.gettempdir()) / "cs3-test-transform-pids"
FAILED_ONCE = Path(tempfile.gettempdir()) / "cs3-test-transform-failed-once"  # the test removes it first
RESOURCES = Path(tempfile.gettempdir()) / "cs3-test-transform-resources"
FAIL_AT = 6  # the batch of a process at which fail_once raises
_calls = [0]


def _mark() -> None:
    PIDS.mkdir(parents=True, exist_ok=True)
    (PIDS / str(os.getpid())).touch()


def record_pid(batch: dict) -> dict:
    """The identity, noting where it ran."""
    _mark()
    return batch


def record_resources(batch: dict) -> dict:
    """The identity, noting the resources Ray assigned to the task it ran in."""
    import ray

    RESOURCES.mkdir(parents=True, exist_ok=True)
    (RESOURCES / str(os.getpid())).write_text(json.dumps(ray.get_runtime_context().get_assigned_resources()))
    return batch


def shift(batch: dict) -> dict:
    """Every token id + 1 (wrapping within 256), noting where it ran."""
    _mark()
    return {"tokens": (np.asarray(batch["tokens"]) + 1) % 256}


def wrong_shape(batch: dict) -> dict:
    return {"tokens": np.asarray(batch["tokens"])[:, :-1]}


def fail_once(batch: dict) -> dict:
    """The identity, except that the FAIL_AT-th batch of the first process to reach it raises (a worker error
    the restarted group does not meet again: FAILED_ONCE marks that it happened)."""
    _calls[0] += 1
    if _calls[0] == FAIL_AT and not FAILED_ONCE.exists():
        FAILED_ONCE.touch()
        raise RuntimeError(f"injected failure in data.transform at batch {FAIL_AT}")
    return batch
