"""Build the model a job config asks for: a named/explicit shape or the user's own factory."""

from __future__ import annotations

import importlib

from torch import nn

from cs3ray.errors import UserError

from .transformer import Transformer


def require_trust(cfg, trust_code: bool, source: str) -> None:
    """Refuse `cfg`'s model.target (code to import and run) unless the user gave trust_code.

    For configs read from a checkpoint (`source` names it); a training config's own target is the
    user's code and needs no such word.
    """
    target = cfg.model.target
    if target and not trust_code:
        raise UserError(f"{source} names model.target '{target}', code that loading it would import and run; "
                        "pass --trust-code if you trust where it came from.")


def model_from_config(cfg, trust_code: bool = True, source: str = "the config") -> nn.Module:
    """`cfg` is a JobConfig; `model.target` ('pkg.module:build') wins over the preset (see require_trust)."""
    require_trust(cfg, trust_code, source)
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
