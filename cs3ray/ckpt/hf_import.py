"""Hugging Face Llama in: a directory's safetensors weights into a cs3ray checkpoint at step 0, or into a model.

Only data is read (config.json, tokenizer.json, safetensors): never pickles, never code. Weights stream: a
tensor's slice is read as byte ranges a block of rows at a time (cs3ray.ckpt.safetensors_io), so a rank reads
only what it holds and never more than a block beyond it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from cs3ray.config import build_config, resolve_run, to_yaml
from cs3ray.models import ByteTokenizer, ModelArgs, Tokenizer, load_tokenizer
from cs3ray.models.hf_llama import (
    SHAPE_FIELDS,
    HFModelError,
    _rotary_rows,  # the one definition of the rotary row order, shared with from_hf/to_hf
    from_hf,
    model_fields,
    names,
    read_config,
    tokenizer_from_hf,
)
from cs3ray.storage import Storage, open_url

from .locations import list_steps
from .manager import CheckpointManager
from .safetensors_io import INDEX, SafetensorsDir

log = logging.getLogger(__name__)
__all__ = ["INDEX", "HFWeights", "import_hf", "load_hf_weights", "read_fields", "read_state"]


def read_fields(storage: Storage) -> dict[str, Any]:
    """The `model` fields of a Hugging Face Llama directory's config.json."""
    return model_fields(read_config(storage.url, storage.options), f"'{storage.url}/config.json'")


def _args(fields: dict[str, Any]) -> ModelArgs:
    return ModelArgs(**{k: fields[k] for k in SHAPE_FIELDS})


class HFWeights:
    """The weights of a Hugging Face Llama directory, by cs3ray name, read a slice at a time.

    Names and shapes are checked against the config from the safetensors headers before a byte of
    weights is read (extra, missing or misshapen tensors are refused as from_hf refuses them).
    """

    def __init__(self, storage: Storage, fields: dict[str, Any]) -> None:
        self.args, self.source = _args(fields), f"'{storage.url}'"
        self.files = SafetensorsDir(storage)
        tie = self.args.tie_embeddings
        # from_hf on shapes alone (meta tensors): its name and shape checks without the data; a tied lm_head
        # is compared with the embedding row by row as it is read (check_tie).
        meta = {name: torch.empty(e.shape, device="meta") for name, e in self.files.entries.items()
                if not (tie and name == "lm_head.weight")}
        self.shapes = {k: tuple(v.shape) for k, v in from_hf(meta, self.args, self.source).items()}
        self.hf = {cs: hf for hf, cs in names(self.args).items()}
        if tie:
            self.hf["output.weight"] = self.hf["tok_emb.weight"]

    def read_into(self, key: str, out: torch.Tensor, offset: tuple[int, ...]) -> None:
        """out <- the slice of tensor `key` (a cs3ray name) at `offset`, in out's dtype and device."""
        hf = self.hf[key]
        if key.endswith(("wq.weight", "wk.weight")):
            # Rows are reordered within each head (cs3ray pairs rotary dimensions): read whole heads.
            hd = self.args.head_dim
            self.files.read_into(hf, out, offset, hd, lambda rows: _rotary_rows(rows, rows.shape[0] // hd, True))
        else:
            self.files.read_into(hf, out, offset)
        if self.args.tie_embeddings and hf == "model.embed_tokens.weight" and "lm_head.weight" in self.files.entries \
                and not self.files.equal_rows(hf, "lm_head.weight", offset[0], offset[0] + out.shape[0]):
            raise HFModelError(f"{self.source} sets tie_word_embeddings but holds an lm_head.weight different from "
                               "the embedding.")


def read_state(storage: Storage, fields: dict[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The cs3ray state dict of a Hugging Face Llama directory whose config gave `fields`, in `dtype` (fp32:
    the master weights training keeps; bf16/fp16 files widen exactly), read a block at a time."""
    weights = HFWeights(storage, fields)
    state: dict[str, torch.Tensor] = {}
    for key, shape in weights.shapes.items():
        if key == "output.weight" and weights.args.tie_embeddings:
            continue
        state[key] = torch.empty(shape, dtype=dtype)
        weights.read_into(key, state[key], (0,) * len(shape))
    if weights.args.tie_embeddings:
        state["output.weight"] = state["tok_emb.weight"]
    return state


def _tokenizer(storage: Storage, path: str | None, vocab: int, note: Callable[[str], None]) -> tuple[Tokenizer, str]:
    """The tokenizer to keep and the data.tokenizer naming it: --tokenizer, DIR/tokenizer.json, else byte."""
    if path:
        tok, name = load_tokenizer(path), path
    elif storage.exists("tokenizer.json"):
        name = f"{storage.url.rstrip('/')}/tokenizer.json"
        tok = tokenizer_from_hf(storage.read_text("tokenizer.json"), f"'{name}'")
    elif vocab >= ByteTokenizer().vocab_size:
        note(f"'{storage.url}' has no tokenizer.json and no --tokenizer was given: using the byte tokenizer.")
        return ByteTokenizer(), "byte"
    else:
        raise HFModelError(f"'{storage.url}' has no tokenizer.json and its {vocab} ids are too few for the byte "
                           f"tokenizer's {ByteTokenizer().vocab_size}: name one with --tokenizer.")
    if tok.vocab_size > vocab:
        raise HFModelError(f"tokenizer '{name}' has {tok.vocab_size} ids, more than the model's vocab_size={vocab}.")
    return tok, name


def import_hf(src: str, run: str, options: dict | None = None, tokenizer: str | None = None,
              note: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Write a Hugging Face Llama directory as run `run`'s checkpoint at step 0; returns {"url", "params", ...}."""
    storage = open_url(src, options)
    fields = read_fields(storage)
    tok, tok_name = _tokenizer(storage, tokenizer, fields["vocab_size"], note)
    run_url = resolve_run(run)
    if list_steps(open_url(run_url, options)):
        raise HFModelError(f"run '{run_url}' already has checkpoints; import into a new run name.")
    state = read_state(storage, fields)
    manager = CheckpointManager(run_url, options, keep=1)
    base = os.path.basename(run_url.rstrip("/"))
    name = base if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", base) else "imported"
    cfg = build_config({"model": fields, "data": {"tokenizer": tok_name}, "run": {"name": name, "dir": run_url},
                        "train": {"seq_len": min(128, fields["max_seq_len"])}}, source=f"'{storage.url}/config.json'")
    meta = {"step": 0, "tokens_seen": 0, "world_size": 1, "strategy": "ddp", "tp": 1, "precision": "fp32",
            "imported_from": storage.url}
    files = {"config.yaml": to_yaml(cfg), "tokenizer.json": tok.to_json()}
    url = manager.save(0, {"model": state, "optim": {}}, meta, {}, files)
    params = sum(t.numel() for k, t in state.items() if not (fields["tie_embeddings"] and k == "output.weight"))
    return {"url": url, "run": run_url, "step": 0, "params": params, "tensors": len(state),
            "tokenizer": tok.describe()}


def _local(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of a state-dict tensor this rank holds (its DTensor shard, else all of it) and where it starts."""
    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    local = value.to_local()
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(local.shape):  # a shard that is not one box of the tensor: nothing cs3ray builds
        raise HFModelError(f"a shard of shape {tuple(local.shape)} is not the {tuple(shape)} its placements "
                           f"{value.placements} describe.")
    return local, tuple(offset)


def load_hf_weights(model: nn.Module, src: str, options: dict | None = None) -> dict[str, Any]:
    """train.init_from=hf:DIR: the directory's weights into a freshly built (and parallelized) model, in place.

    Each rank reads only the rows and columns of the tensors it holds (FSDP/TP shards, a pipeline stage),
    in the model's dtype, straight into its parameters: the model plus a block of rows at a time.
    """
    storage = open_url(src, options)
    weights = HFWeights(storage, read_fields(storage))
    wanted = get_model_state_dict(model)  # the parameters themselves (sharded DTensors under FSDP2/TP)
    for key, value in wanted.items():
        if key not in weights.shapes:
            raise HFModelError(f"the Hugging Face model '{storage.url}' has no tensor for '{key}'.")
        if weights.shapes[key] != tuple(value.shape):
            raise HFModelError(f"tensor '{key}' of '{storage.url}' has shape {weights.shapes[key]}, the model "
                               f"{tuple(value.shape)}: leave the model fields unset to take the directory's.")
    with torch.no_grad():
        for key, value in wanted.items():
            local, offset = _local(value)
            weights.read_into(key, local, offset)
    log.info("initialized weights from Hugging Face model %s", storage.url)
    return {"step": 0, "url": storage.url}
