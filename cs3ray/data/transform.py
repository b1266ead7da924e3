"""`data.transform`: the user's batch transform 'pkg.module:fn', loaded once and applied with its result checked.

The function takes and returns a batch in Ray Data's `map_batches` form, `{'tokens': array}` with
one (seq_len+1)-token sample per row. It may change token values (masking, noise, remapping) but not
the batch's shape: the global order decides which samples a step holds, and it stays exact. Like
`model.target`, only the training config's own transform is ever imported; a checkpoint's is not.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from cs3ray.models.factory import import_callable

from .corpus import DataError

Transform = Callable[[np.ndarray], np.ndarray]


class _Checked:
    """`fn` applied to a (rows, seq_len+1) int64 batch, its result held to the same shape and integer ids."""

    def __init__(self, spec: str, fn: Callable) -> None:
        self.spec, self.fn = spec, fn

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        out = self.fn({"tokens": tokens})
        got = out.get("tokens") if isinstance(out, dict) else None
        arr = np.asarray(got) if got is not None else None
        if arr is None or arr.shape != tokens.shape or not np.issubdtype(arr.dtype, np.integer):
            what = (f"{type(out).__name__}" if arr is None else f"'tokens' of shape {arr.shape} and dtype {arr.dtype}")
            raise DataError(f"data.transform '{self.spec}' must return {{'tokens': integer array of shape "
                            f"{tokens.shape}}}; it returned {what}.")
        return arr.astype(np.int64, copy=False)


def load_transform(spec: str | None) -> Transform | None:
    """The checked transform `data.transform` names, or None when it names none."""
    return _Checked(spec, import_callable(spec, "data.transform")) if spec else None
