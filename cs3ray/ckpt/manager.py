"""The checkpoint manager: save / load / latest / close, over DCP on any fsspec URL.

Layout under the run directory (later tiers extend it, never replace it):

    step-00000100/
        __0_0.distcp ...     DCP shards (model + optimizer), one file per rank
        .metadata            DCP's index of the shards (a pickle: only read after verification)
        rank-00000.pt        per-rank state (RNG), loadable with weights_only=True
        state.json           step, tokens seen, schedule, scaler ... (JSON)
        config.yaml          the resolved job config
        tokenizer.json       the tokenizer, so the folder describes itself
        manifest.json        files + sizes + sha256, written last
"""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from cs3ray.storage import Storage, is_remote, open_url

from .manifest import MANIFEST, CheckpointError, read_manifest, verify, write_manifest

log = logging.getLogger(__name__)
# Loading or saving in one process (inference, export, tests) is intended, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
STEP_RE = re.compile(r"^step-(\d{8})$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def dcp_writer(folder: Storage):
    if is_remote(folder.url):
        return FsspecWriter(folder.url, **folder.fs.storage_options)
    return FileSystemWriter(folder.url)


def dcp_reader(folder: Storage):
    if is_remote(folder.url):
        return FsspecReader(folder.url, **folder.fs.storage_options)
    return FileSystemReader(folder.url)


def list_steps(run: Storage) -> list[int]:
    """Steps of complete checkpoints (a manifest present), oldest first."""
    steps = []
    for name in run.ls():
        m = STEP_RE.match(name)
        if m and run.exists(name, MANIFEST):
            steps.append(int(m.group(1)))
    return sorted(steps)


class CheckpointManager:
    """Sharded, checksummed checkpoints of one run; every method is called on every rank."""

    def __init__(self, run_url: str, storage_options: dict | None = None, keep: int = 3) -> None:
        self.run = open_url(run_url, storage_options)
        self.keep = keep

    def steps(self) -> list[int]:
        return list_steps(self.run)

    def latest(self) -> int | None:
        """Newest complete checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any],
             files: dict[str, str]) -> str:
        """Write a checkpoint of `step`; returns its URL once the manifest is committed.

        state: DCP state dict (sharded tensors, same keys on every rank); meta: JSON-able run
        state written by rank 0; rank_state: this rank's own tensors (RNG); files: extra text
        files by name (config, tokenizer).
        """
        name = step_dir(step)
        folder = self.run.child(name)
        if _rank() == 0 and self.run.exists(name):
            folder.rm()  # an earlier attempt at this step that never got its manifest
        _barrier()
        dcp.save(state, storage_writer=dcp_writer(folder))
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        folder.write_bytes(buf.getvalue(), f"rank-{_rank():05d}.pt")
        if _rank() == 0:
            folder.write_text(json.dumps(meta, indent=1, sort_keys=True), "state.json")
            for fname, text in files.items():
                folder.write_text(text, fname)
        _barrier()
        if _rank() == 0:
            write_manifest(folder, step, _world(), {"meta": meta})
            self._prune()
        _barrier()
        return folder.url

    def _prune(self) -> None:
        """Keep the newest `keep` complete checkpoints; drop older ones and stale partial folders."""
        steps = self.steps()
        keep = set(steps[-self.keep:])
        newest = steps[-1] if steps else -1
        for name in self.run.ls():
            m = STEP_RE.match(name)
            if not m:
                continue
            s = int(m.group(1))
            if s not in keep and s <= newest:
                self.run.child(name).rm()

    def load(self, state: dict[str, Any], step: int | None = None) -> tuple[int, dict, dict | None]:
        """Load the newest good checkpoint (or `step`) into `state` in place.

        Returns (step, meta, this rank's rank_state or None when the world size changed).
        Checksums are verified by rank 0 before any rank reads a byte; a corrupt newest
        checkpoint falls back to the one before it, saying so.
        """
        candidates = [step] if step is not None else list(reversed(self.steps()))
        chosen, problems = None, []
        if _rank() == 0:
            for s in candidates:
                try:
                    verify(self.run.child(step_dir(s)))
                    chosen = s
                    break
                except CheckpointError as exc:
                    problems.append(str(exc))
                    log.warning("skipping checkpoint: %s", exc)
        chosen, problems = _broadcast((chosen, problems))
        if chosen is None:
            detail = f": {problems[0]}" if problems else ""
            raise CheckpointError(f"no loadable checkpoint in '{self.run.url}'{detail}")
        folder = self.run.child(step_dir(chosen))
        dcp.load(state, storage_reader=dcp_reader(folder))
        meta = json.loads(folder.read_text("state.json"))
        manifest = read_manifest(folder)
        rank_state = None
        if manifest["world_size"] == _world():
            raw = folder.read_bytes(f"rank-{_rank():05d}.pt")
            rank_state = torch.load(io.BytesIO(raw), weights_only=True)
        return chosen, meta, rank_state

    def close(self) -> None:
        """Nothing is in flight in synchronous mode; async tiers wait here."""
