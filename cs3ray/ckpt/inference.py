"""Load a trained model for inference from a run or a single checkpoint folder."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import yaml

from cs3ray.config import JobConfig, build_config
from cs3ray.models import ByteTokenizer
from cs3ray.models.factory import model_from_config
from cs3ray.storage import Storage, StorageError, open_url

from .locations import list_steps, open_folder, step_dir
from .manager import load_state
from .manifest import MANIFEST, CheckpointError


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: ByteTokenizer
    config: JobConfig
    step: int
    url: str


def resolve_run(run: str) -> str:
    """A RUN argument -> URL: a name means runs/<name>; paths and URLs are taken as they are."""
    if "://" in run or os.sep in run or os.path.exists(run):
        return run
    return os.path.join("runs", run)


def resolve_checkpoint(run: str, options: dict | None = None) -> Storage:
    """The checkpoint folder a RUN argument means: itself if it has a manifest, else its newest."""
    storage = open_url(resolve_run(run), options)
    try:
        if storage.exists(MANIFEST):
            return storage
        exists = storage.exists()
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None
    if not exists:
        raise CheckpointError(f"run or checkpoint '{run}' does not exist (looked at '{storage.url}').")
    steps = list_steps(storage)
    if not steps:
        raise CheckpointError(f"'{storage.url}' has no complete checkpoint yet.")
    return storage.child(step_dir(steps[-1]))


def load_for_inference(run: str, options: dict | None = None, dtype: torch.dtype = torch.float32,
                       trust_code: bool = False) -> LoadedModel:
    """Verify a checkpoint and load its weights into a fresh model, whatever strategy wrote it.

    A model.target in the checkpoint's config is imported only with trust_code, the caller's word
    (--trust-code, or model.trust_code of the caller's own config); one stored in the checkpoint's
    config is ignored.
    """
    folder = resolve_checkpoint(run, options)
    loc, step, manifest = open_folder(folder)
    try:
        cfg = build_config(yaml.safe_load(loc.read(step, "config.yaml", manifest)), source=f"{folder.url}/config.yaml")
        tokenizer = ByteTokenizer.from_json(loc.read(step, "tokenizer.json", manifest).decode())
    except StorageError as exc:
        raise CheckpointError(f"checkpoint '{folder.url}' is incomplete: {exc}") from None
    model = model_from_config(cfg, trust_code=trust_code, source=f"checkpoint '{folder.url}'")
    state = {"model": model.state_dict()}
    load_state(state, loc.reader(step, manifest))
    model.load_state_dict(state["model"])
    model.to(dtype).eval()
    return LoadedModel(model, tokenizer, cfg, int(manifest["step"]), folder.url)
