"""FSDP2's gradient reduce-scatter, compressed: phase 1 of the two-phase all-reduce is a reduce-scatter.

Installed per FSDP module with `set_custom_reduce_scatter`. FSDP2 calls it once per module in
backward with the module's padded flat gradient (one chunk per rank) and the op it chose (AVG,
or SUM when it divides itself). With error feedback each rank keeps a residual for the other
ranks' chunks of the unsharded gradients it reduces, (N-1)/N of them, which undoes part of what
sharding saves; it is counted in `state_bytes`.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .hook import CompressionHook


class CompressedReduceScatter:
    """FSDP2's `ReduceScatter` interface (allocate + call), duck-typed: torch exports the class only privately."""

    def __init__(self, state: CompressionHook, key: str) -> None:
        self.state, self.key = state, key

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh buffer for FSDP's reduce-scatter input or output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        """Reduce-scatter `input_tensor` into `output_tensor`, compressed once warm-up is over."""
        state = self.state
        if not state.compressing:
            world = dist.get_world_size(group)
            fp32 = 4 * input_tensor.numel() * (world - 1) / world
            state.reduce.stats.add(round(fp32 * input_tensor.element_size() / 4), fp32)
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
        elif op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            state.reduce.reduce_scatter(self.key, input_tensor, output_tensor, average=op == dist.ReduceOp.AVG)
        else:
            raise ValueError(f"compressed reduce-scatter supports AVG and SUM, not {op}")


def install_fsdp_compression(model: nn.Module, state: CompressionHook) -> CompressionHook:
    """Compress the reduce-scatter of every FSDP module of `model`.

    FSDP2 reduce-scatters once per micro-batch, so the optimizer step, not a call, ends a sync:
    the engine calls `state.end_sync()` after each step's backward passes."""
    for name, module in model.named_modules():
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, name or "<root>"))
    return state
