"""Host values of tensors that may be fake: a rehearsal (`cs3 plan --rehearse`) runs the real step on
torch's fake tensors, which have shapes and devices but no values.

Where the step needs a value on the host (the loss to report, whether fp16 gradients are finite,
the gradient norm), a fake tensor answers with the value of an ordinary step: a finite loss of
unknown size (nan), finite gradients. Real tensors are read as before.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor, or a DTensor whose local shard is one."""
    return isinstance(t, FakeTensor) or isinstance(getattr(t, "_local_tensor", None), FakeTensor)


def host_float(t: torch.Tensor) -> float:
    """float(t); nan for a fake tensor (no value to read)."""
    return float("nan") if is_fake(t) else float(t)


def host_bool(t: torch.Tensor, fake: bool) -> bool:
    """bool(t); `fake` for a fake tensor: the branch a rehearsal takes."""
    return fake if is_fake(t) else bool(t)
