"""Export a checkpoint as one consolidated file (safetensors or torch) that loads without cs3ray."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .chunks import METADATA
from .dcp_metadata import load_metadata
from .inference import resolve_checkpoint
from .locations import open_folder
from .manager import load_state
from .manifest import CheckpointError

FORMATS = ("safetensors", "torch")


def consolidated_model(run_or_ckpt: str, options: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (unsharded) model tensors of a checkpoint, whatever strategy wrote it, and its manifest."""
    loc, step, manifest = open_folder(resolve_checkpoint(run_or_ckpt, options))
    # Verified against the manifest, then unpickled admitting DCP's metadata classes only.
    metadata = load_metadata(loc.read(step, METADATA, manifest), f"{loc.folder(step).url}/{METADATA}")
    model: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if not model:
        raise CheckpointError(f"checkpoint '{loc.folder(step).url}' holds no model tensors.")
    load_state({"model": model}, loc.reader(step, manifest))
    return model, manifest


def export(run_or_ckpt: str, out: str, fmt: str = "safetensors", options: dict | None = None,
           dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Write the model of a checkpoint to `out`, its floating tensors cast to `dtype` (None: as
    stored, fp32 whatever precision trained it); returns {"path", "step", "tensors", "bytes", "dtype"}."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}.")
    model, manifest = consolidated_model(run_or_ckpt, options)
    if dtype is not None:
        model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    info = {"step": str(manifest["step"]), "format": "cs3ray", "config_hash": str(manifest.get("config_hash", ""))}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, out, metadata=info)
    else:
        torch.save(model, out)  # a plain dict of tensors: torch.load(out, weights_only=True)
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in model.values() if v.is_floating_point()})
    return {"path": out, "step": int(manifest["step"]), "tensors": len(model), "bytes": os.path.getsize(out),
            "dtype": ",".join(dtypes)}
