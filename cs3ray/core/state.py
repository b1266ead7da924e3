"""What a checkpoint holds for a rank, as DCP state dicts that reshard across strategies.

Tensors are keyed by parameter names with wrapper prefixes removed, so a checkpoint written
by FSDP on 2 ranks loads into DDP on 1 (DCP reshards). The optimizer state is keyed the same
way ("state.<param name>.<exp_avg|...>"); ZeRO-1 ranks write only the parameters they own,
and every strategy asks only for what it holds, so any layout loads into any other.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

_WRAPPER_PARTS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def clean_fqn(name: str) -> str:
    """'module.blocks.0._orig_mod.attn.wq.weight' -> 'blocks.0.attn.wq.weight'."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(clean name, parameter) of every trainable parameter, tied ones once."""
    return [(clean_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state tensors up front (zeros, step 0), exactly as its first step would.

    Checkpoints then always contain every state tensor, and loading can fill them in place.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                # The step count stays on the host, as torch's AdamW keeps it unless capturable or fused.
                optimizer.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32, device="cpu"),
                                      "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO wraps a local one)."""
    return getattr(optimizer, "optim", optimizer)


def capture(model: nn.Module, optimizer: torch.optim.Optimizer,
            aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """References to this rank's model and optimizer tensors, for DCP to save or load in place.

    `aliases` renames optimizer entries: a pipeline's last stage keeps a tied embedding's state
    under the embedding's name, as a single process does.
    """
    opt = local_optimizer(optimizer)
    state = {}
    for name, p in named_trainable(model):
        if p in opt.state and opt.state[p]:
            state[(aliases or {}).get(name, name)] = opt.state[p]
    return {"model": get_model_state_dict(model), "optim": {"state": state}}


def restore(model: nn.Module, state: dict[str, Any]) -> None:
    """Finish a load: DCP filled the optimizer tensors in place; the model goes through set_*."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def rng_state() -> dict[str, Any]:
    """This rank's random generators (saved per rank, restored when the world size is unchanged)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
