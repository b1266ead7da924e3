"""Build the model a job config asks for: a named/explicit shape or the user's own factory."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

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


def import_callable(spec: str, field: str) -> Callable[..., Any]:
    """The function a 'pkg.module:fn' setting names (`field` says which setting, for the error)."""
    module_name, fn_name = spec.split(":")
    try:
        fn = functools.reduce(getattr, fn_name.split("."), importlib.import_module(module_name))
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{field} '{spec}' cannot be imported: {exc}.") from None
    if not callable(fn):
        raise UserError(f"{field} '{spec}' names a {type(fn).__name__}, not a function.")
    return fn


def model_from_config(cfg, trust_code: bool = True, source: str = "the config") -> nn.Module:
    """`cfg` is a JobConfig; `model.target` ('pkg.module:build') wins over the preset (see require_trust)."""
    require_trust(cfg, trust_code, source)
    target = cfg.model.target
    if not target:
        return Transformer(cfg.model.args())
    model = import_callable(target, "model.target")(cfg.model.model_dump())
    if not isinstance(model, nn.Module):
        raise UserError(f"model.target '{target}' returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
