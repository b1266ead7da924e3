"""What a checkpoint holds for a worker, as DCP state dicts that reshard across strategies."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names (wrapper prefixes removed).

    Names rather than positions are what makes a checkpoint load into another strategy or
    world size; DCP stores each rank's shard and reshards on load.
    """
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put loaded state back into the (possibly wrapped) model and optimizer."""
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=True))


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
