"""The Ray Data settings cs3ray's pipelines run under, set in one place and restored when the last one ends.

A pipeline started inside `ray_data_settings()` runs with Ray Data's progress bars off (cs3ray shows its
own progress) and the `ray.data` logger at ERROR (no per-dataset lines in a training or preparation log),
and, where asked, with results in input order. A Dataset copies the current DataContext when it is
created, while the logger is read as it runs, so the settings hold until the last pipeline inside them
has finished: nested or overlapping users (two ranks' streams in one process) share one saved state,
restored when the last of them leaves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

_LOCK = threading.Lock()
_USERS = 0
_SAVED: tuple[Any, ...] | None = None


@contextlib.contextmanager
def ray_data_settings(*, preserve_order: bool | None = None, progress_bars: bool = False) -> Iterator[Any]:
    """The current DataContext with cs3ray's settings (`preserve_order` None: left as it is); every
    setting is restored when the last caller inside leaves."""
    import ray.data

    global _USERS, _SAVED
    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    with _LOCK:
        if _USERS == 0:
            _SAVED = ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level
        _USERS += 1
        if preserve_order is not None:
            ctx.execution_options.preserve_order = preserve_order
        ctx.enable_progress_bars = progress_bars
        if not progress_bars:
            logger.setLevel(logging.ERROR)
    try:
        yield ctx
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0 and _SAVED is not None:
                ctx.execution_options.preserve_order, ctx.enable_progress_bars = _SAVED[:2]
                logger.setLevel(_SAVED[2])
                _SAVED = None
