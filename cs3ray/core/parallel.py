"""Parallelism applied to an unmodified model from the outside (torchtitan's apply_* style).

The order is fixed and matters:
  0. pipeline parallel - keeps only this rank's stage of the plain model; everything below sees the stage
  1. tensor parallel   - rewrites Linear weights into DTensor shards; must see the plain model
  2. activation ckpt   - wraps whole blocks, around the TP-sharded linears
  3. compile           - compiles each (wrapped) block, so the graph includes recompute + TP comms
  4. data parallel     - FSDP2 / DDP last: they must see the final module structure and parameters
ZeRO-1 is an optimizer-side choice (`core.optim.build_optimizer` with `zero_group`, which shards
AdamW's state over the data-parallel group); the model is wrapped with DDP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from .compress import CompressionHook, install_fsdp_compression, install_plain_reduce_scatter, register_compression
from .compress.dgc import DgcSettings
from .mesh import Topology
from .precision import DTYPES


def _blocks(model: nn.Module) -> nn.ModuleDict | None:
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, nn.ModuleDict) else None


def apply_pp(model: nn.Module, rank: int, pp: int, virtual: int = 1) -> tuple[nn.Module, list[nn.Module]]:
    """Pipeline parallel: keep only this pipeline rank's blocks (and the embedding first, norm and output last).

    Returns (the model holding them, the stage modules the schedule runs): the model itself, or with
    `virtual` > 1 stages per rank (interleaved schedules) one module per stage sharing its submodules.
    Parameters keep their names, so every later apply_* and checkpoints see an ordinary, smaller model.
    """
    from .pipeline import split_rank

    return split_rank(model, rank, pp, virtual)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallel: column-parallel q/k/v and w1/w3, row-parallel wo and w2.

    Activations between blocks stay replicated, so each block costs two all-reduces forward
    (after wo and w2) and two backward: attention's and the MLP's input enter as one replicated
    DTensor each, so the gradients of q, k and v (of w1 and w3) add up locally and are all-reduced
    once there, not once per projection. Nothing outside the blocks changes.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    blocks = _blocks(model)
    if blocks is None:
        raise ValueError("parallel.tp > 1 needs a model with a `blocks` ModuleDict of transformer blocks")
    shared = Replicate()
    plan = {"attn": PrepareModuleInput(input_layouts=(shared, None, None, None),
                                       desired_input_layouts=(shared, None, None, None)),
            "ffn": PrepareModuleInput(input_layouts=(shared,), desired_input_layouts=(shared,)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel()}
    for block in blocks.values():
        parallelize_module(block, tp_mesh, plan)


def apply_ac(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model)
    if blocks is None:
        raise ValueError("train.activation_checkpointing needs a model with a `blocks` ModuleDict")
    for name, block in list(blocks.items()):
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block separately: small graphs compile fast and are reused by every layer."""
    blocks = _blocks(model)
    if blocks is None:
        model.compile()
        return
    for name, block in list(blocks.items()):
        blocks[name] = torch.compile(block, fullgraph=False)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, precision: str) -> None:
    """FSDP2: shard parameters, gradients and optimizer state of every block and the root over dp.

    With bf16/fp16, FSDP all-gathers parameters in the compute dtype (half the traffic) and
    reduce-scatters gradients in fp32, while the sharded fp32 parameters stay the master copy.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    blocks = _blocks(model) or {}
    items = list(blocks.items()) if blocks else []
    for i, (_, block) in enumerate(items):
        # The last block's parameters are needed first in backward: keep them gathered after forward.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(items) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


DDP_BUCKET_MB = 25  # torch's default bucket cap: gradients are all-reduced in buckets of about this size


def apply_ddp(model: nn.Module, device: torch.device, group: Any = None,
              bucket_cap_mb: int = DDP_BUCKET_MB) -> nn.Module:
    """Replicate the model; gradients are all-reduced in buckets overlapped with backward."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view avoids a copy of every gradient into the comm buckets; the only
    # buffers (RoPE tables) are constants, so broadcasting them before every forward is waste.
    return DDP(model, device_ids=ids, process_group=group, bucket_cap_mb=bucket_cap_mb,
               gradient_as_bucket_view=True, broadcast_buffers=False)


def dgc_settings(compression: Any, clip: float) -> DgcSettings | None:
    """int4_sparse's DGC settings from `compression.dgc` (None when off); `clip` is train.clip, the local
    clipping bound unless dgc.clip_norm sets its own."""
    dgc = compression.dgc
    if compression.codec != "int4_sparse" or dgc.enabled is False or (dgc.enabled is None and compression.hierarchical):
        return None
    return DgcSettings(momentum=dgc.momentum, clip_norm=clip if dgc.clip_norm is None else dgc.clip_norm,
                       factor_masking=dgc.factor_masking, warmup_steps=dgc.warmup_steps,
                       warmup_density=dgc.warmup_density)


def apply_compression(model: nn.Module, compression: Any, group: Any = None,
                      topology: Topology | None = None, clip: float = 0.0) -> CompressionHook | None:
    """Sync a DDP model's gradient buckets with the compressed all-reduce when `compression.codec` asks,
    or through shared memory inside each node first when `compression.hierarchical` does (needs `topology`)."""
    hierarchical = topology if compression.hierarchical else None
    if (compression.codec == "none" and hierarchical is None) or not isinstance(model, DDP):
        return None
    return register_compression(model, compression.codec, compression.density, compression.error_feedback,
                                compression.warmup_steps, group, hierarchical, dgc_settings(compression, clip))


def apply_fsdp_compression(model: nn.Module, compression: Any, group: Any,
                           topology: Topology | None = None, clip: float = 0.0) -> CompressionHook | None:
    """Compress FSDP2's gradient reduce-scatter of every sharded module when `compression.codec` asks,
    through shared memory inside each node first when `compression.hierarchical` does (needs `topology`).
    Uncompressed on gloo, it goes through cs3ray's point-to-point exchange (see compress.fsdp)."""
    hierarchical = topology if compression.hierarchical else None
    if compression.codec == "none" and hierarchical is None:
        install_plain_reduce_scatter(model, group)
        return None
    state = CompressionHook(compression.codec, compression.density, compression.error_feedback,
                            compression.warmup_steps, group, hierarchical, dgc=dgc_settings(compression, clip))
    return install_fsdp_compression(model, state)
