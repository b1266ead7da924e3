"""A run's checkpoints as a catalog: name one by RUN/STEP, list them all, verify them all.

`cs3 ckpt ls|verify|export` call these; so can a job or a notebook, with the same storage options.
Opening one checkpoint to read it is open_checkpoint's job (reading.py).
"""

from __future__ import annotations

import os
import re
from typing import Callable

from cs3ray.config import open_run, resolve_run
from cs3ray.storage import Storage, StorageError, open_url

from .locations import list_steps, open_folder, step_dir
from .manifest import MANIFEST, CheckpointError, read_manifest

_RUN_STEP = re.compile(r"(.+)/(\d+)")


def resolve_target(target: str, storage_options: dict | None = None) -> str:
    """RUN, RUN/STEP (a step number) or a checkpoint folder -> the run as given, or the URL of that step's folder.

    A path that exists is taken as it is, so a folder named like a number is not read as a step.
    """
    m = _RUN_STEP.fullmatch(target)
    if m and not os.path.exists(target):
        return open_url(resolve_run(m.group(1)), storage_options).child(step_dir(int(m.group(2)))).url
    return target


def list_checkpoints(run: str, storage_options: dict | None = None) -> dict:
    """A run's complete checkpoints, oldest first, from their manifests (not verified).

    {"run": url, "checkpoints": [{"step", "world_size", "bytes_total", "bytes_written", "chunks",
    "created", "url"}, ...]}; a run that does not exist is a CheckpointError.
    """
    storage = open_run(run, storage_options, CheckpointError)
    try:
        steps = list_steps(storage)
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None
    rows = []
    for s in steps:
        folder = storage.child(step_dir(s))
        m = read_manifest(folder)
        rows.append({"step": s, "world_size": m["world_size"], "bytes_total": m.get("bytes_total"),
                     "bytes_written": m.get("bytes_written"), "chunks": len(m.get("chunks", {})),
                     "created": m.get("created"), "url": folder.url})
    return {"run": storage.url, "checkpoints": rows}


def _folders(target: str, storage_options: dict | None) -> tuple[Storage, list[Storage]]:
    """(what `target` names, the checkpoint folders to verify: itself, or every complete one of the run)."""
    storage = open_url(resolve_run(resolve_target(target, storage_options)), storage_options)
    try:
        if storage.exists(MANIFEST):
            return storage, [storage]
        return storage, [storage.child(step_dir(s)) for s in list_steps(storage)]
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None


def verify_checkpoints(target: str, storage_options: dict | None = None,
                       on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Hash every file and every chunk of RUN's checkpoints (or of RUN/STEP, or a folder) against their manifests.

    One result per checkpoint, oldest first: {"url", "ok": True, "step", "files", "chunks"} or
    {"url", "ok": False, "error"}; `on_result(result)` is called as each is done. A damaged
    checkpoint is a result, not an exception; nothing to verify is a CheckpointError.
    """
    storage, folders = _folders(target, storage_options)
    if not folders:
        raise CheckpointError(f"'{storage.url}' has no complete checkpoint to verify.")
    results = []
    for folder in folders:
        try:
            _, step, m = open_folder(folder, deep=True)
            result = {"url": folder.url, "ok": True, "step": step, "files": len(m["files"]),
                      "chunks": len(m.get("chunks", {}))}
        except (CheckpointError, StorageError) as exc:
            result = {"url": folder.url, "ok": False, "error": str(exc)}
        results.append(result)
        if on_result:
            on_result(result)
    return results
