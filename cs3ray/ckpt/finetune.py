"""Fine-tuning: freeze parameters by name pattern, and start from another run's weights."""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from cs3ray.core.state import clean_fqn

from .inference import resolve_checkpoint
from .locations import open_folder
from .manager import load_state
from .manifest import CheckpointError

log = logging.getLogger(__name__)


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
        raise CheckpointError(f"train.freeze pattern(s) {unused} match no parameter (names look like "
                              f"'{clean_fqn(next(iter(model.named_parameters()))[0])}').")
    return frozen


def load_init_weights(model: nn.Module, run_or_ckpt: str, options: dict | None = None) -> dict[str, Any]:
    """Load only the model weights of a run's newest (or a given) checkpoint into `model`, in place.

    Works for a freshly built and parallelized model of any strategy/world size (DCP reshards);
    call it on every rank. Returns {"step", "url"} of the checkpoint used.
    """
    folder = resolve_checkpoint(run_or_ckpt, options)
    loc, step, manifest = open_folder(folder)
    state = {"model": get_model_state_dict(model)}
    load_state(state, loc.reader(step, manifest))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
    log.info("initialized weights from %s (step %d)", folder.url, step)
    return {"step": step, "url": folder.url}
