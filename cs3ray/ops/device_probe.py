"""A device check that runs on a CPU-only host: cs3ray's own allocations are moved to another device.

On a GPU every tensor cs3ray allocates for the data it serves has to sit on that data's device:
a `torch.empty(n)` without `device=` lands in host memory, where the GPU's kernels and nccl
cannot use it. A CPU build of torch cannot compute on CUDA tensors, fake or not, and FSDP2 and
autocast refuse the meta device, so the step cannot simply run elsewhere. Instead it runs on
fake CPU tensors while every tensor that cs3ray's own code creates without naming a device is
created on `meta`: one that meets the model's data raises `FakeTensorDeviceMismatchError`,
naming the op. Allocations by torch itself (FSDP2, the optimizer) are left alone; a tensor that
cs3ray keeps on the host on purpose names `device="cpu"`.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch

# The factories cs3ray calls; each places its result on the default device unless told otherwise.
FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "randint", "rand", "randn", "linspace", "eye",
             "empty_strided", "scalar_tensor")


def _from_cs3ray(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith("cs3ray.")


@contextlib.contextmanager
def cs3ray_allocations_on(device: str | torch.device = "meta") -> Iterator[None]:
    """Within: a factory called from a cs3ray module without `device=` creates its tensor on `device`.

    Unlike `torch.set_default_device`, this reaches every thread and autograd's backward hooks,
    where gradient compression runs.
    """
    originals = {name: getattr(torch, name) for name in FACTORIES}

    def redirect(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def placed(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("device") is None and _from_cs3ray():
                kwargs["device"] = device
            return factory(*args, **kwargs)

        return placed

    for name, factory in originals.items():
        setattr(torch, name, redirect(factory))
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)
