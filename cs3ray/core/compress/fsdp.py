"""FSDP2's gradient reduce-scatter, compressed: phase 1 of the two-phase all-reduce is a reduce-scatter.

Installed per FSDP module with `set_custom_reduce_scatter`. FSDP2 calls it once per module in
backward with the module's padded flat gradient (one chunk per rank) and the op it chose (AVG,
or SUM when it divides itself). With error feedback each rank keeps a residual for the other
ranks' chunks of the unsharded gradients it reduces, (N-1)/N of them, which undoes part of what
sharding saves; it is counted in `state_bytes`.

Uncompressed, FSDP2's fp32 reduce-scatter is torch's collective, except on gloo: gloo runs a
reduce-scatter as a whole all-reduce (twice the bytes of a reduce-scatter, see docs/benchmarks.md,
`bench comm --ranks`), so there it is phase 1 of cs3ray's exchange with the exact codec.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .allreduce import CompressedAllReduce
from .codec import make_codec
from .hook import CompressionHook


def _allocate(size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


def _average(op: object) -> bool:
    if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
        raise ValueError(f"cs3ray's reduce-scatter supports AVG and SUM, not {op}")
    return op == dist.ReduceOp.AVG


class PlainReduceScatter:
    """FSDP2's uncompressed reduce-scatter: torch's collective, or on gloo cs3ray's point-to-point exchange.

    One instance serves every FSDP module of a model (FSDP2 reduce-scatters one module at a time),
    so the exchange's scratch buffers exist once.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        gloo = dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1
        self.exchange = CompressedAllReduce(make_codec("none"), group, error_feedback=False) if gloo else None

    allocate = staticmethod(_allocate)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        """Reduce-scatter `input_tensor` (one padded chunk per rank) into `output_tensor`, blocking."""
        if self.exchange is None or input_tensor.dtype != torch.float32:
            dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
        else:
            self.exchange.reduce_scatter("fp32", input_tensor, output_tensor, average=_average(op))


def install_plain_reduce_scatter(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Uncompressed runs on gloo: every FSDP module of `model` reduce-scatters through cs3ray's exchange."""
    plain = PlainReduceScatter(group)
    if plain.exchange is None:
        return
    for module in model.modules():
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(plain)


class CompressedReduceScatter:
    """FSDP2's `ReduceScatter` interface (allocate + call), duck-typed: torch exports the class only privately."""

    def __init__(self, state: CompressionHook, key: str, plain: PlainReduceScatter) -> None:
        self.state, self.key, self.plain = state, key, plain  # plain: the warm-up's exchange, shared

    allocate = staticmethod(_allocate)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        """Reduce-scatter `input_tensor` into `output_tensor`, compressed once warm-up is over."""
        state = self.state
        if not state.compressing:
            world = dist.get_world_size(group)
            fp32 = 4 * input_tensor.numel() * (world - 1) / world
            state.reduce.stats.add(round(fp32 * input_tensor.element_size() / 4), fp32)
            self.plain(output_tensor, input_tensor, group, op)
        else:
            state.prepare(self.key, input_tensor, dist.get_world_size(group))
            state.reduce.reduce_scatter(self.key, input_tensor, output_tensor, average=_average(op))


def install_fsdp_compression(model: nn.Module, state: CompressionHook) -> CompressionHook:
    """Compress the reduce-scatter of every FSDP module of `model`.

    FSDP2 reduce-scatters once per micro-batch, so the optimizer step, not a call, ends a sync:
    the engine calls `state.end_sync()` after each step's backward passes."""
    plain = PlainReduceScatter(state.group)
    for name, module in model.named_modules():
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(CompressedReduceScatter(state, name or "<root>", plain))
    return state
