"""Export a checkpoint as one consolidated file (safetensors or torch) that loads without cs3ray."""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunks import METADATA
from .inference import resolve_checkpoint
from .locations import open_folder
from .manifest import CheckpointError

FORMATS = ("safetensors", "torch")


def consolidated_model(run_or_ckpt: str, options: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (unsharded) model tensors of a checkpoint, whatever strategy wrote it, and its manifest."""
    loc, step, manifest = open_folder(resolve_checkpoint(run_or_ckpt, options))
    # Verified against the manifest before unpickling.
    metadata = pickle.loads(loc.read(step, METADATA, manifest))
    model: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint '{loc.folder(step).url}' holds no model tensors.")
    dcp.load({"model": model}, storage_reader=loc.reader(step, manifest))
    return model, manifest


def export(run_or_ckpt: str, out: str, fmt: str = "safetensors", options: dict | None = None) -> dict[str, Any]:
    """Write the model of a checkpoint to `out`; returns {"path", "step", "tensors", "bytes"}."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}.")
    model, manifest = consolidated_model(run_or_ckpt, options)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    info = {"step": str(manifest["step"]), "format": "cs3ray", "config_hash": str(manifest.get("config_hash", ""))}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, out, metadata=info)
    else:
        torch.save(model, out)  # a plain dict of tensors: torch.load(out, weights_only=True)
    return {"path": out, "step": int(manifest["step"]), "tensors": len(model), "bytes": os.path.getsize(out)}
