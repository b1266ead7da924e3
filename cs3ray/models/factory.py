"""Build the model a job config asks for: a named/explicit shape or the user's own factory."""

from __future__ import annotations

import importlib

from torch import nn

from cs3ray.errors import UserError

from .transformer import Transformer


def model_from_config(cfg) -> nn.Module:
    """`cfg` is a JobConfig; `model.target` ('pkg.module:build') wins over the preset."""
    target = cfg.model.target
    if not target:
        return Transformer(cfg.model.args())
    module_name, fn_name = target.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"model.target '{target}' cannot be imported: {exc}.") from None
    model = fn(cfg.model.model_dump())
    if not isinstance(model, nn.Module):
        raise UserError(f"model.target '{target}' returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
