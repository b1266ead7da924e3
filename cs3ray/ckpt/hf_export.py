"""Hugging Face Llama out: a checkpoint's model as a directory that transformers' LlamaForCausalLM loads."""

from __future__ import annotations

import json
import math
from typing import Any, Iterator, Sequence

import torch
import yaml

from cs3ray.config import stored_config
from cs3ray.models import TokenizerError, tokenizer_from_json
from cs3ray.models.hf_llama import _rotary_rows, hf_config, names, tokenizer_files  # _rotary_rows: see to_hf
from cs3ray.storage import open_url

from .manifest import CheckpointError
from .reading import open_checkpoint
from .safetensors_io import BLOCK_BYTES, INDEX, write_file
from .stream import TensorStream, model_tensors

SHARD_BYTES = 5 * 2**30  # transformers' own default shard size


def _shards(items: list[tuple[str, torch.dtype, tuple[int, ...]]], limit: int) -> list[list]:
    """Consecutive groups of tensors of at most `limit` bytes each (a larger tensor alone)."""
    shards: list[list] = [[]]
    size = 0
    for item in items:
        n = math.prod(item[2]) * item[1].itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def export_hf(run_or_ckpt: str, out: str, options: dict | None = None, dtype: torch.dtype | None = None,
              shard_bytes: int = SHARD_BYTES, replicas: Sequence[str] = (),
              stored_replicas: bool = False) -> dict[str, Any]:
    """Write a checkpoint's model to the directory `out` (safetensors, config.json, tokenizer files);
    returns {"path", "step", "tensors", "bytes", "dtype", "files"}.

    Streamed: the model is never built, and the shard files are written a tensor (a block of rows) at a
    time, each tensor read from the checkpoint as it is written (verified, with open_checkpoint's fallback
    for damaged files; a damaged chunk met while writing stops the export, its files removed).
    """
    ckpt = open_checkpoint(run_or_ckpt, options, replicas=replicas, stored_replicas=stored_replicas)
    where = f"checkpoint of step {ckpt.step}"
    cfg = stored_config(yaml.safe_load(ckpt.read("config.yaml")), source=f"the {where}'s config.yaml")
    if cfg.model.target:
        raise CheckpointError(f"the {where} holds a model.target '{cfg.model.target}' model; --format hf exports "
                              "cs3ray's built-in transformer only.")
    args = cfg.model.args()
    metadata = ckpt.metadata()  # verified; every declared size fits the stored bytes
    stored = model_tensors(metadata)
    if not stored:
        raise CheckpointError(f"checkpoint '{ckpt.url}' holds no model tensors.")
    expected = set(names(args).values()) | ({"output.weight"} if args.tie_embeddings else set())
    if set(stored) != expected:
        odd = sorted(set(stored) ^ expected)[0]
        raise CheckpointError(f"the {where} does not hold a Llama of its config's shape (tensor '{odd}').")
    try:
        tok = tokenizer_from_json(ckpt.read("tokenizer.json").decode("utf-8"), f"the {where}'s tokenizer.json")
    except (TokenizerError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"the {where} has an unusable tokenizer.json: {exc}") from None
    hf_names = names(args)
    items = [(hf, dtype or stored[cs].properties.dtype, tuple(stored[cs].size)) for hf, cs in hf_names.items()]
    dtype_name = str(items[0][1]).removeprefix("torch.")

    dest = open_url(out, options)
    if dest.exists() and dest.ls():
        raise CheckpointError(f"output directory '{dest.url}' is not empty; name a new one with --out.")
    dest.makedirs()
    tensors = TensorStream(ckpt, metadata)

    def blocks(hf: str) -> Iterator[torch.Tensor]:
        # One stored tensor at a time, reordered (q/k: whole heads) and cast a block of rows at a time into one
        # reused buffer (the writer takes each block before the next is made): no allocation churn per block.
        cs = hf_names[hf]
        t = tensors.read(cs)
        heads = args.n_heads if cs.endswith("wq.weight") else args.kv_heads if cs.endswith("wk.weight") else 0
        group = args.head_dim if heads else 1
        row = max(1, math.prod(t.shape[1:]) * t.element_size())
        per = max(group, BLOCK_BYTES // row // group * group)
        want = dtype or t.dtype
        buf = None if want == t.dtype and not heads else torch.empty((min(per, t.shape[0]), *t.shape[1:]), dtype=want)
        for lo in range(0, t.shape[0], per):
            rows = t[lo:lo + per]
            if heads:
                rows = _rotary_rows(rows, rows.shape[0] // group, to_pairs=False)
            if buf is None:
                yield rows.contiguous()
            else:
                yield buf[:rows.shape[0]].copy_(rows)

    shards = _shards(items, shard_bytes)
    weight_map, total, written = {}, 0, []
    try:
        for i, shard in enumerate(shards, 1):
            name = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            written.append(name)
            # transformers refuses safetensors without format=pt
            total += write_file(dest, name, shard, blocks, {"format": "pt"})
            weight_map.update({hf: name for hf, _, _ in shard})
    except BaseException:
        for name in written:
            dest.rm(name, missing_ok=True)
        raise
    files = {"config.json": json.dumps(hf_config(args, tok.bos_id, tok.eos_id, tok.pad_id, dtype_name), indent=2),
             "generation_config.json": json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                                                   "pad_token_id": tok.pad_id}, indent=2),
             **tokenizer_files(tok, args.max_seq_len)}
    if len(shards) > 1:
        size = sum(math.prod(shape) * dt.itemsize for _, dt, shape in items)
        files[INDEX] = json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2)
    for name, text in files.items():
        dest.write_text(text, name)
    return {"path": dest.url, "step": ckpt.step, "tensors": len(items), "bytes": total,
            "dtype": dtype_name, "files": len(shards) + len(files)}
