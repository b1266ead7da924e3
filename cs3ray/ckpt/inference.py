"""Load a trained model for inference from a run or a single checkpoint folder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import yaml

from cs3ray.config import JobConfig, resolve_run, stored_config
from cs3ray.models import Tokenizer, TokenizerError, tokenizer_from_json
from cs3ray.models.factory import model_from_config
from cs3ray.models.hf_llama import hf_path
from cs3ray.storage import Storage, StorageError, open_url

from .locations import list_steps, step_dir
from .manifest import MANIFEST, CheckpointError
from .reading import open_checkpoint
from .restore import Checkpoint


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: JobConfig
    step: int
    url: str


def resolve_checkpoint(run: str, options: dict | None = None) -> Storage:
    """The checkpoint folder a RUN argument names: itself if it has a manifest, else the run's newest
    complete one (not verified: open_checkpoint verifies, and falls back past a damaged one)."""
    if hf_path(run) is not None:
        raise CheckpointError(f"'{run}' names a Hugging Face directory, not a cs3ray checkpoint: import it with "
                              "`cs3 ckpt import-hf`.")
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
                       trust_code: bool = False, replicas: Sequence[str] = (),
                       stored_replicas: bool = False) -> LoadedModel:
    """Load the weights of a run's newest good checkpoint (or of one checkpoint folder) into a fresh
    model, whatever strategy wrote it; verified, with open_checkpoint's fallback.

    A model.target in the checkpoint's config is imported only with trust_code, the caller's word
    (--trust-code, or model.trust_code of the caller's own config); one stored in the checkpoint's
    config is ignored. So are the replicas its config lists, unless `stored_replicas` (the caller's
    --use-stored-replicas); `replicas` are URLs the caller names to fall back to.
    """
    built: dict[str, Any] = {}

    def prepare(ckpt: Checkpoint) -> dict:
        cfg = stored_config(yaml.safe_load(ckpt.read("config.yaml")), source=f"{ckpt.url}/config.yaml")
        try:
            tokenizer = tokenizer_from_json(ckpt.read("tokenizer.json").decode(), f"'{ckpt.url}/tokenizer.json'")
        except (TokenizerError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"checkpoint '{ckpt.url}' has an unusable tokenizer.json: {exc}") from None
        model = model_from_config(cfg, trust_code=trust_code, source=f"checkpoint '{ckpt.url}'")
        built.update(model=model, tokenizer=tokenizer, config=cfg)
        return {"model": model.state_dict()}

    ckpt = open_checkpoint(run, options, prepare=prepare, replicas=replicas, stored_replicas=stored_replicas)
    model = built["model"]
    model.load_state_dict(ckpt.state["model"])
    model.to(dtype).eval()
    return LoadedModel(model, built["tokenizer"], built["config"], ckpt.step, ckpt.url)
