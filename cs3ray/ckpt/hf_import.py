"""Hugging Face Llama in: a directory's safetensors weights into a cs3ray checkpoint at step 0, or into a model.

Only data is read (config.json, tokenizer.json, safetensors): never pickles, never code.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from cs3ray.config import build_config, resolve_run, to_yaml
from cs3ray.models import ByteTokenizer, ModelArgs, Tokenizer, load_tokenizer
from cs3ray.models.hf_llama import SHAPE_FIELDS, HFModelError, from_hf, model_fields, read_config, tokenizer_from_hf
from cs3ray.names import check_name
from cs3ray.storage import Storage, is_remote, open_url

from .locations import list_steps
from .manager import CheckpointManager

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_tensors(storage: Storage) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's model.safetensors, or of the shards its index names, as fp32."""
    if storage.exists(INDEX):
        try:
            weight_map = json.loads(storage.read_text(INDEX))["weight_map"]
            names = list(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            raise HFModelError(f"'{storage.url}/{INDEX}' is not a valid safetensors index (no weight_map).") from None
        # Shard names are any file name Hugging Face tools chose, but never a path out of the directory.
        files = sorted({check_name(name, f"'{storage.url}/{INDEX}'", HFModelError, ours=False) for name in names})
        for name in files:
            if not storage.exists(name):
                raise HFModelError(f"'{storage.url}' lacks the shard '{name}' that {INDEX} names.")
    elif storage.exists(SINGLE):
        files = [SINGLE]
    else:
        raise HFModelError(f"'{storage.url}' has neither {SINGLE} nor {INDEX}; cs3ray reads safetensors weights "
                           "only (never pickled .bin files).")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(_read_file(storage, name))
    return tensors


def _read_file(storage: Storage, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load

    try:
        if is_remote(storage.url):
            raw = load(storage.read_bytes(name))
        else:  # memory-mapped: one tensor at a time is copied
            with safe_open(storage.path(name), "pt") as f:
                raw = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    except (SafetensorError, ValueError, OSError) as exc:
        raise HFModelError(f"'{storage.url}/{name}' is not a readable safetensors file ({str(exc)[:120]}).") from None
    # fp32 master weights, as training keeps them (bf16/fp16 files widen exactly).
    return {k: v.float() if v.is_floating_point() else v for k, v in raw.items()}


def read_fields(storage: Storage) -> dict[str, Any]:
    """The `model` fields of a Hugging Face Llama directory's config.json."""
    return model_fields(read_config(storage.url, storage.options), f"'{storage.url}/config.json'")


def read_state(storage: Storage, fields: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The cs3ray state dict of a Hugging Face Llama directory whose config gave `fields`."""
    args = ModelArgs(**{k: fields[k] for k in SHAPE_FIELDS})
    return from_hf(read_tensors(storage), args, f"'{storage.url}'")


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


def load_hf_weights(model: nn.Module, src: str, options: dict | None = None) -> dict[str, Any]:
    """train.init_from=hf:DIR: the directory's weights into a freshly built (and parallelized) model, in place.

    Every rank reads the whole model and keeps the part it holds (FSDP/TP shards, a pipeline stage).
    """
    storage = open_url(src, options)
    state = read_state(storage, read_fields(storage))
    wanted = get_model_state_dict(model)
    for key, value in wanted.items():
        if key not in state:
            raise HFModelError(f"the Hugging Face model '{storage.url}' has no tensor for '{key}'.")
        if tuple(state[key].shape) != tuple(value.shape):
            raise HFModelError(f"tensor '{key}' of '{storage.url}' has shape {tuple(state[key].shape)}, the model "
                               f"{tuple(value.shape)}: leave the model fields unset to take the directory's.")
    set_model_state_dict(model, {k: state[k] for k in wanted},
                         options=StateDictOptions(full_state_dict=True, strict=True))
    log.info("initialized weights from Hugging Face model %s", storage.url)
    return {"step": 0, "url": storage.url}
