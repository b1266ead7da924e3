"""Export a checkpoint as one consolidated file (safetensors or torch) that loads without cs3ray, or as a
Hugging Face Llama directory (hf)."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .manifest import CheckpointError
from .reading import open_checkpoint
from .restore import Checkpoint

FORMATS = ("safetensors", "torch", "hf")  # hf: a Hugging Face Llama directory (cs3ray.ckpt.hf_export)


def consolidated_model(run_or_ckpt: str, options: dict | None = None, files: dict[str, bytes] | None = None,
                       replicas: Sequence[str] = (), stored_replicas: bool = False
                       ) -> tuple[dict[str, torch.Tensor], dict]:
    """Full (unsharded) model tensors of a run's newest good checkpoint (or of one checkpoint folder),
    whatever strategy wrote it, and its manifest; verified, with open_checkpoint's fallback (to
    `replicas`, and to the stored config's only with `stored_replicas`). The names in `files` are
    filled with those files of the checkpoint used (verified too)."""
    def prepare(ckpt: Checkpoint) -> dict:
        for name in files or {}:
            files[name] = ckpt.read(name)
        # Verified, unpickled admitting DCP's classes only, its sizes no larger than the stored bytes.
        metadata = ckpt.metadata()
        model: dict[str, torch.Tensor] = {}
        for key, md in metadata.state_dict_metadata.items():
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
                model[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if not model:
            raise CheckpointError(f"checkpoint '{ckpt.url}' holds no model tensors.")
        return {"model": model}

    ckpt = open_checkpoint(run_or_ckpt, options, prepare=prepare, replicas=replicas, stored_replicas=stored_replicas)
    return ckpt.state["model"], ckpt.manifest


def export(run_or_ckpt: str, out: str, fmt: str = "safetensors", options: dict | None = None,
           dtype: torch.dtype | None = None, replicas: Sequence[str] = (),
           stored_replicas: bool = False) -> dict[str, Any]:
    """Write the model of a checkpoint to `out` (a directory for "hf"), its floating tensors cast to `dtype`
    (None: as stored, fp32 whatever precision trained it); returns {"path", "step", "tensors", "bytes", "dtype"}."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown export format '{fmt}': use one of {', '.join(FORMATS)}.")
    if fmt == "hf":
        from .hf_export import export_hf  # streamed a tensor at a time: no consolidated model

        return export_hf(run_or_ckpt, out, options, dtype, replicas=replicas, stored_replicas=stored_replicas)
    extra = {"tokenizer.json": b""}
    model, manifest = consolidated_model(run_or_ckpt, options, extra, replicas, stored_replicas)
    if dtype is not None:
        model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    info = {"step": str(manifest["step"]), "format": "cs3ray", "config_hash": str(manifest.get("config_hash", "")),
            # The self-describing tokenizer (type byte|bpe): the export decodes without the run.
            "tokenizer": extra["tokenizer.json"].decode("utf-8", errors="replace")}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.items()}, out, metadata=info)
        tokenizer = None
    else:
        torch.save(model, out)  # a plain dict of tensors: torch.load(out, weights_only=True)
        # A torch file has no metadata: the tokenizer goes beside it, so the export still decodes alone.
        tokenizer = tokenizer_path(out)
        with open(tokenizer, "wb") as f:
            f.write(extra["tokenizer.json"])
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in model.values() if v.is_floating_point()})
    return {"path": out, "step": int(manifest["step"]), "tensors": len(model), "bytes": os.path.getsize(out),
            "dtype": ",".join(dtypes), **({"tokenizer": tokenizer} if tokenizer else {})}


def tokenizer_path(out: str) -> str:
    """Where a torch-format export's tokenizer goes: model-step10.pt -> model-step10.tokenizer.json."""
    return os.path.splitext(out)[0] + ".tokenizer.json"
