"""Fine-tuning: start from another run's weights (freezing is cs3ray.core.freeze)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from .reading import open_checkpoint

log = logging.getLogger(__name__)


def load_init_weights(model: nn.Module, run_or_ckpt: str, options: dict | None = None) -> dict[str, Any]:
    """Load only the model weights of a run's newest good (or a given) checkpoint into `model`, in place.

    Works for a freshly built and parallelized model of any strategy/world size (DCP reshards);
    call it on every rank. Verified, with open_checkpoint's fallback. Returns {"step", "url"} of
    the checkpoint used.
    """
    ckpt = open_checkpoint(run_or_ckpt, options, prepare=lambda _: {"model": get_model_state_dict(model)})
    set_model_state_dict(model, ckpt.state["model"], options=StateDictOptions(strict=True))
    log.info("initialized weights from %s (step %d)", ckpt.url, ckpt.step)
    return {"step": ckpt.step, "url": ckpt.url}
