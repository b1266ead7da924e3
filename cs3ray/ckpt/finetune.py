"""Fine-tuning: start from another run's weights (freezing is cs3ray.core.freeze)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from cs3ray.models.hf_llama import hf_path

from .hf_import import load_hf_weights
from .reading import open_checkpoint

log = logging.getLogger(__name__)


def load_init_weights(model: nn.Module, run_or_ckpt: str, options: dict | None = None, replicas: Sequence[str] = (),
                      stored_replicas: bool = False) -> dict[str, Any]:
    """Load only the model weights of a run's newest good (or a given) checkpoint into `model`, in place.

    Works for a freshly built and parallelized model of any strategy/world size (DCP reshards);
    call it on every rank. Verified, with open_checkpoint's fallback (to `replicas`; to those the run's
    stored config lists only with `stored_replicas`: train.init_from names a run, not its replicas).
    Returns {"step", "url"} of the checkpoint used. `hf:DIR` names a Hugging Face Llama directory
    instead (cs3ray.ckpt.hf_import).
    """
    src = hf_path(run_or_ckpt)
    if src is not None:  # hf:DIR, a Hugging Face Llama directory
        return load_hf_weights(model, src, options)
    ckpt = open_checkpoint(run_or_ckpt, options, prepare=lambda _: {"model": get_model_state_dict(model)},
                           replicas=replicas, stored_replicas=stored_replicas)
    set_model_state_dict(model, ckpt.state["model"], options=StateDictOptions(strict=True))
    log.info("initialized weights from %s (step %d)", ckpt.url, ckpt.step)
    return {"step": ckpt.step, "url": ckpt.url}
