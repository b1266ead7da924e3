"""Mixed precision: low-precision compute under autocast, fp32 master weights, loss scaling.

Parameters and optimizer state always stay fp32 (the "master weights"); autocast runs the
matmuls in bf16/fp16. fp16's narrow exponent needs dynamic loss scaling; bf16 does not.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from cs3ray.errors import UserError

from .fake import host_bool

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISIONS = ("auto", *DTYPES)


def native_bf16(device: torch.device | str) -> bool:
    """Whether the device multiplies bf16 in hardware.

    CPUs without AVX512-BF16 or AMX emulate bf16 matmuls far slower than fp32 (figures:
    docs/benchmarks.md), so there mixed precision would only slow training down.
    """
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """A concrete precision: 'auto' is bf16 where the device runs it natively, else fp16 on
    GPUs (with loss scaling) and fp32 on CPUs. Named precisions are kept as asked."""
    if precision != "auto":
        return precision
    if native_bf16(device):
        return "bf16"
    return "fp16" if torch.device(device).type == "cuda" else "fp32"


def inference_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The dtype a model is cast to for inference (serve, generate, bench serve).

    'auto' resolves as for training; a named precision is kept as asked on every device (fp16
    on a CPU without fp16 matmul hardware is slow, but computes what was asked).
    """
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision '{precision}': use one of {', '.join(PRECISIONS)}.")
    return DTYPES[resolve_precision(precision, device)]


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in for a (resolved) precision name."""
    return DTYPES[precision]


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Autocast for bf16/fp16; a no-op for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=DTYPES[precision]):
        yield


class LossScaler:
    """Dynamic loss scaling for fp16: skip the step on inf/nan and back off, grow after clean steps.

    A disabled scaler (bf16/fp32) passes everything through, so the train step has one shape.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 200,
                 backoff: float = 0.5, growth: float = 2.0) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.backoff, self.growth = growth_interval, backoff, growth
        self.clean_steps = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: list[torch.Tensor]) -> bool:
        """Divide gradients by the scale; return False (skip the step) when any is inf/nan.

        Every rank must take the same decision, so the inf/nan flag is all-reduced.
        """
        if not self.enabled:
            return True
        # Sharded gradients (FSDP2/TP DTensors): check the local shard, then agree across ranks.
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
        inv = 1.0 / self.scale
        torch._foreach_mul_(grads, inv)
        device = grads[0].device if grads else torch.device("cpu")
        # 1 where any local gradient is inf/nan, computed where the gradients are: one value crosses to the host.
        bad = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float().reshape(1) if grads \
            else torch.zeros(1, device=device)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        finite = not host_bool(bad[0] != 0, fake=False)
        if finite:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= self.growth
                self.clean_steps = 0
        else:
            self.scale *= self.backoff
            self.clean_steps = 0
            self.skipped += 1
        return finite

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved scaler; a checkpoint of another precision keeps this one's own scale.

        An fp32 or bf16 run saves scale 1 (no scaling): resumed in fp16 that would train unscaled
        until the scale grew back, so only an fp16 run's scale is taken over. Checkpoints older
        than the `enabled` entry were scaled exactly when their scale is not 1.
        """
        self.skipped = state["skipped"]
        if self.enabled and state.get("enabled", state["scale"] != 1.0):
            self.scale, self.clean_steps = state["scale"], state["clean_steps"]
