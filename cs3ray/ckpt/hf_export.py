"""Hugging Face Llama out: a checkpoint's model as a directory that transformers' LlamaForCausalLM loads."""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
import yaml

from cs3ray.config import stored_config
from cs3ray.models import TokenizerError, tokenizer_from_json
from cs3ray.models.hf_llama import hf_config, names, to_hf, tokenizer_files
from cs3ray.storage import open_url

from .export import consolidated_model
from .manifest import CheckpointError

SHARD_BYTES = 5 * 2**30  # transformers' own default shard size
INDEX = "model.safetensors.index.json"


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `limit` bytes each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += n
    return shards


def export_hf(run_or_ckpt: str, out: str, options: dict | None = None, dtype: torch.dtype | None = None,
              shard_bytes: int = SHARD_BYTES, replicas: Sequence[str] = (),
              stored_replicas: bool = False) -> dict[str, Any]:
    """Write a checkpoint's model to the directory `out` (safetensors, config.json, tokenizer files);
    returns {"path", "step", "tensors", "bytes", "dtype", "files"}."""
    from safetensors.torch import save

    extra = {"config.yaml": b"", "tokenizer.json": b""}
    model, manifest = consolidated_model(run_or_ckpt, options, extra, replicas, stored_replicas)
    where = f"checkpoint of step {manifest['step']}"
    cfg = stored_config(yaml.safe_load(extra["config.yaml"]), source=f"the {where}'s config.yaml")
    if cfg.model.target:
        raise CheckpointError(f"the {where} holds a model.target '{cfg.model.target}' model; --format hf exports "
                              "cs3ray's built-in transformer only.")
    args = cfg.model.args()
    expected = set(names(args).values()) | ({"output.weight"} if args.tie_embeddings else set())
    if set(model) != expected:
        odd = sorted(set(model) ^ expected)[0]
        raise CheckpointError(f"the {where} does not hold a Llama of its config's shape (tensor '{odd}').")
    try:
        tok = tokenizer_from_json(extra["tokenizer.json"].decode("utf-8"), f"the {where}'s tokenizer.json")
    except (TokenizerError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"the {where} has an unusable tokenizer.json: {exc}") from None
    tensors = to_hf(model, args)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")

    dest = open_url(out, options)
    if dest.exists() and dest.ls():
        raise CheckpointError(f"output directory '{dest.url}' is not empty; name a new one with --out.")
    shards = _shards(tensors, shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        blob = save(shard, metadata={"format": "pt"})  # transformers refuses safetensors without format=pt
        dest.write_bytes(blob, name)
        weight_map.update(dict.fromkeys(shard, name))
        total += len(blob)
    files = {"config.json": json.dumps(hf_config(args, tok.bos_id, tok.eos_id, tok.pad_id, dtype_name), indent=2),
             "generation_config.json": json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                                                   "pad_token_id": tok.pad_id}, indent=2),
             **tokenizer_files(tok, args.max_seq_len)}
    if len(shards) > 1:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        files[INDEX] = json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
    for name, text in files.items():
        dest.write_text(text, name)
    return {"path": dest.url, "step": int(manifest["step"]), "tensors": len(tensors), "bytes": total,
            "dtype": dtype_name, "files": len(shards) + len(files)}
