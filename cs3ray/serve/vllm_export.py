"""A run's checkpoint as the Hugging Face directory vLLM loads: cs3ray's own HF export, made once per run,
step and dtype in a node's cache and reused by every replica (and restart) that serves that step."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from cs3ray.ckpt import open_checkpoint
from cs3ray.ckpt.hf_export import export_hf

DEFAULT_CACHE = "~/.cache/cs3ray/vllm"
# cs3ray's own files beside the HF ones (vLLM ignores them): the replica tokenizes prompts with the
# run's tokenizer, so the ids it sends are the ones the exported tokenizer.json decodes.
CS3_TOKENIZER = "cs3ray-tokenizer.json"
CS3_CONFIG = "cs3ray-config.yaml"


@dataclass(frozen=True)
class Export:
    """An export in the cache: its directory, the checkpoint step, and whether this call wrote it."""

    path: str
    step: int
    created: bool


def run_key(run_url: str) -> str:
    """A directory name for a run: readable, and unique per URL (two runs named alike stay apart)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", run_url.rstrip("/").rsplit("/", 1)[-1])[:48] or "run"
    return f"{name}-{hashlib.sha256(run_url.encode()).hexdigest()[:12]}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run_cache(cache_dir: str | None, run_url: str) -> Path:
    """The cache folder of `run_url`'s exports."""
    return Path(os.path.expanduser(cache_dir or DEFAULT_CACHE)) / run_key(run_url)


def export_path(cache_dir: str | None, run_url: str, step: int, dtype: torch.dtype) -> Path:
    """Where the export of `run_url`'s `step` in `dtype` lives in the cache."""
    return run_cache(cache_dir, run_url) / f"step-{step:08d}-{dtype_name(dtype)}"


@contextlib.contextmanager
def export_lock(cache_dir: str | None, run_url: str, dtype: torch.dtype) -> Iterator[None]:
    """Held while one process looks for, or writes, an export of `run_url` in `dtype`: replicas starting
    together on a node wait for the first one's export instead of each converting the whole model."""
    where = run_cache(cache_dir, run_url)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / f".export-{dtype_name(dtype)}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        yield


def cached_export(run_url: str, storage_options: dict | None, dtype: torch.dtype, cache_dir: str | None = None,
                  replicas: Sequence[str] = (), stored_replicas: bool = False) -> Export:
    """The HF export of `run_url`'s newest good checkpoint in `dtype`: from the cache, else written there.

    One process per cache exports a step (export_lock); it writes into a private temporary directory
    renamed into place, so a reader never sees a partial export, also after a crash mid-export.
    """
    step = open_checkpoint(run_url, storage_options, replicas=replicas, stored_replicas=stored_replicas).step
    if (path := export_path(cache_dir, run_url, step, dtype)).is_dir():
        return Export(str(path), step, False)
    with export_lock(cache_dir, run_url, dtype):
        if path.is_dir():  # written by the replica that held the lock before this one
            return Export(str(path), step, False)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            done = export_hf(run_url, str(tmp), storage_options, dtype=dtype, replicas=replicas,
                             stored_replicas=stored_replicas)
            # A newer checkpoint may have landed in between: the export names the step it holds.
            step = done["step"]
            path = export_path(cache_dir, run_url, step, dtype)
            if path.is_dir():
                return Export(str(path), step, False)
            ckpt = open_checkpoint(run_url, storage_options, step=step, replicas=replicas,
                                   stored_replicas=stored_replicas)
            (tmp / CS3_TOKENIZER).write_bytes(ckpt.read("tokenizer.json"))
            (tmp / CS3_CONFIG).write_bytes(ckpt.read("config.yaml"))
            tmp.rename(path)
            return Export(str(path), step, True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
