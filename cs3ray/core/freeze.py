"""Freezing parameters by name pattern, for fine-tuning."""

from __future__ import annotations

import fnmatch

from torch import nn

from cs3ray.config import ConfigError

from .state import clean_fqn


def apply_freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad=False on parameters whose clean name matches a glob; returns their names.

    Call it before the optimizer is built (and before DDP/FSDP wrap the model), so frozen
    parameters get no optimizer state and no gradient buckets. A pattern that matches
    nothing is an error: a typo would otherwise silently train everything.
    """
    if not patterns:
        return []
    frozen, used = [], set()
    for name, p in model.named_parameters():
        clean = clean_fqn(name)
        hits = [pat for pat in patterns if fnmatch.fnmatchcase(clean, pat)]
        if hits:
            p.requires_grad_(False)
            frozen.append(clean)
            used.update(hits)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ConfigError(f"train.freeze pattern(s) {unused} match no parameter (names look like "
                          f"'{clean_fqn(next(iter(model.named_parameters()))[0])}').")
    return frozen
