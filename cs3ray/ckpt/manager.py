"""The checkpoint manager: save / load / latest / close, over DCP on any fsspec URL, in tiers.

Layout under the run directory (later tiers extend it, never replace it):

    step-00000100/
        .metadata            DCP's index of the shards (a pickle: only read after verification)
        rank-00000.pt        per-rank state (RNG), loadable with weights_only=True
        state.json           step, tokens seen, schedule, scaler ... (JSON)
        config.yaml          the resolved job config
        tokenizer.json       the tokenizer, so the folder describes itself
        manifest.json        files + sizes + sha256 + the chunks it references, written last
    chunks/ab/ab12...        tensor data, content-addressed (shared by checkpoints: incremental)

Tiers of one save: (t0) memory: every rank's chunks go to its node's keeper actor and one
other node's; (t1) the folder above, written in a background thread when async (only the
copy of the tensors blocks training, with their hashing on a CPU host, see staging; large
files bypass the page cache, see cs3ray.direct_io);
(t2) a copy in every `replicas` URL. Format-1 checkpoints (plain `__R_0.distcp` files, no
chunks) still load.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cs3ray.config import redact_config_text
from cs3ray.config.redact import redact_values
from cs3ray.errors import UserError
from cs3ray.storage import RETRY_DEADLINE_S, Storage, StorageError, open_url

from .chunks import ChunkStore, ChunkWriter
from .locations import MemoryLocation, StorageLocation, collect, list_steps, replicate, step_dir
from .manifest import CheckpointError, write_manifest
from .restore import Checkpoint, barrier, rank, restore, single_process_quiet, world
from .staging import Stager

log = logging.getLogger(__name__)
CONFIG = "config.yaml"


@dataclass
class Restored:
    """What `load` used: the step, the tier (memory | peer | storage | replica) and its URL."""

    step: int
    source: str
    url: str


class CheckpointManager:
    """Sharded, checksummed, incremental checkpoints of one run; every method is called on every rank."""

    def __init__(self, run_url: str, storage_options: dict | None = None, keep: int = 3, *,
                 async_mode: str = "disabled", replicas: list[str] | None = None, memory_tier: bool = False,
                 incremental: bool = True, retry_deadline_s: float = RETRY_DEADLINE_S) -> None:
        # Every storage call (chunk uploads, reads, listings) retries transient errors up to retry_deadline_s.
        self.run = open_url(run_url, storage_options, retry_deadline_s)
        self.keep, self.async_mode, self.incremental = keep, async_mode, incremental
        self.primary = StorageLocation(self.run, "storage")
        self.replicas = [StorageLocation(open_url(u, storage_options, retry_deadline_s), "replica")
                         for u in replicas or []]
        self.memory = None
        if memory_tier:
            import ray

            if ray.is_initialized():
                from .keeper import MemoryTier

                self.memory = MemoryTier(self.run.url)
        self.last_restore: Restored | None = None
        self.last_save: dict[str, Any] = {}
        self._known: set[str] = set()  # chunks of this rank's previous checkpoint (all still referenced)
        # GC lists every stored chunk of a location on this manager's first save there and after
        # a failed one (orphans of a crash may be there); otherwise it diffs the manifests it drops.
        self._sweep = self._storage_urls()
        self._pending: Future | None = None
        # The async writer runs at training's priority: a low-priority writer gets no CPU during the
        # step and leaves its work for when training waits on it; at equal priority it overlaps, and
        # O_DIRECT writes keep its CPU small (figures: docs/benchmarks.md).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if async_mode == "async" else None
        self._stager = Stager()
        # Background saves talk over their own gloo group, never the training group's stream.
        self._group = dist.new_group(backend="gloo") if self._pool and dist.is_initialized() else None

    def _storage_urls(self) -> set[str]:
        return {loc.url for loc in (self.primary, *self.replicas)}

    @classmethod
    def from_config(cls, run_url: str, cfg: Any) -> "CheckpointManager":
        """The manager a job config asks for (checkpoint and storage sections)."""
        c = cfg.checkpoint
        return cls(run_url, cfg.storage.options, c.keep, async_mode=c.async_mode, replicas=list(c.replicas),
                   memory_tier=c.memory_tier, incremental=c.incremental, retry_deadline_s=c.retry_deadline_s)

    def steps(self) -> list[int]:
        return list_steps(self.run)

    def latest(self) -> int | None:
        """Newest complete checkpoint's step (in storage or memory), or None."""
        steps = self.steps() + (MemoryLocation(self.memory).steps() if self.memory else [])
        return max(steps) if steps else None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], rank_state: dict[str, Any],
             files: dict[str, str]) -> str:
        """Checkpoint `step`; returns its URL (in async mode, before the write has finished).

        state: DCP state dict (sharded tensors, same keys on every rank); meta: JSON-able run
        state written by rank 0; rank_state: this rank's own tensors (RNG); files: extra text
        files by name (config, tokenizer). Returns once the tensors are copied when async.
        """
        self.wait()  # one save at a time: GC and dedup rely on it
        buf = io.BytesIO()
        torch.save(rank_state, buf)
        # Credentials never reach the folder, its manifest's config_hash, replicas or the keepers (nor does
        # a URL's password in the meta: imported_from, say).
        files = {k: redact_config_text(v) if k == CONFIG else v for k, v in files.items()}
        job = (step, state, redact_values(json.loads(json.dumps(meta))), buf.getvalue(), files)
        if self._pool is None:
            self._write(*job)
        else:
            # Staging copies the tensors here, before save returns, so the optimizer may change
            # the weights right after; only the write runs in the background.
            staged = self._stager.stage(state)  # the buffers are free: the previous write has finished
            self._pending = self._pool.submit(self._write, step, staged, *job[2:], self._stager.digests)
        return self.run.child(step_dir(step)).url

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write(self, step: int, state: dict, meta: dict, rank_file: bytes, files: dict[str, str],
               digests: dict[tuple[int, int], str] | None = None) -> None:
        group, me = self._group, rank()
        folder = self.run.child(step_dir(step))
        if me == 0 and self.run.exists(step_dir(step)):
            folder.rm()  # an earlier attempt at this step that never got its manifest
        barrier(group)
        writer = ChunkWriter(folder, ChunkStore(self.run), self._known if self.incremental else frozenset(), digests)
        try:
            try:
                with single_process_quiet():
                    dcp.save(state, storage_writer=writer, process_group=group)
            except CheckpointException as exc:  # a BaseException: make it an ordinary, readable error
                cause = next(iter(exc.failures.values()), exc)
                why = str(cause) if isinstance(cause, UserError) else repr(cause)
                raise CheckpointError(f"checkpoint of step {step} to '{folder.url}' failed: {why}") from None
            rank_name = f"rank-{me:05d}.pt"
            folder.write_bytes(rank_file, rank_name, durable=False)
            small = {}
            if me == 0:
                small = {"state.json": json.dumps(meta, indent=1, sort_keys=True).encode(),
                         **{k: v.encode() for k, v in files.items()}}
                for name, blob in small.items():
                    folder.write_bytes(blob, name, durable=False)
            if self.memory is not None:
                self.memory.push(step, writer.blobs, {rank_name: rank_file})
            self.run.sync()  # everything this rank wrote is durable before rank 0 commits the manifest
            barrier(group)
            if me == 0:
                self._commit(step, folder, meta, files, writer, small)
            barrier(group)
        except BaseException:
            self._known = set()  # what this rank wrote may not be referenced by anything
            self._sweep = self._storage_urls()
            raise
        self._known = set(writer.blobs)

    def _commit(self, step: int, folder: Storage, meta: dict, files: dict[str, str], writer: ChunkWriter,
                small: dict[str, bytes]) -> None:
        """Rank 0: manifest (t1 visible), memory commit (t0), replicas (t2), then GC."""
        config = files.get(CONFIG, "")
        total = sum(writer.chunks.values())
        manifest = write_manifest(folder, step, world(), {
            "meta": meta, "chunks": writer.chunks, "config_hash": hashlib.sha256(config.encode()).hexdigest(),
            "bytes_total": total, "bytes_written": writer.new_bytes})
        if self.memory is not None:
            from .chunks import METADATA

            self.memory.commit(step, manifest, {**small, METADATA: folder.read_bytes(METADATA)})
        for rep in self.replicas:
            try:
                replicate(self.primary, rep, step, manifest)
                collect(rep, self.keep, sweep=rep.url in self._sweep)
                self._sweep.discard(rep.url)
            except (StorageError, CheckpointError) as exc:
                self._sweep.add(rep.url)
                log.warning("replica '%s' not updated: %s", rep.url, exc)
        collect(self.primary, self.keep, sweep=self.primary.url in self._sweep)
        self._sweep.discard(self.primary.url)
        self.last_save = {"step": step, "bytes_total": total, "bytes_written": writer.new_bytes}

    def locations(self) -> list:
        """Restore order: memory, primary, replicas."""
        out: list = [MemoryLocation(self.memory)] if self.memory is not None else []
        return out + [self.primary, *self.replicas]

    def load(self, state: dict[str, Any], step: int | None = None) -> tuple[int, dict, dict | None]:
        """Load the newest good checkpoint (or `step`) into `state` in place.

        Returns (step, meta, this rank's rank_state or None when the world size changed);
        `last_restore` says which tier it came from. Rank 0 verifies checksums before any
        rank reads a byte; a corrupt or missing copy falls back memory -> primary -> replica
        -> the previous checkpoint, saying so in one warning line (see restore).
        """
        self.wait()
        got: dict[str, Any] = {}

        def prepare(ckpt: Checkpoint) -> dict[str, Any]:
            got["meta"] = json.loads(ckpt.read("state.json"))
            got["rank_state"] = None
            if ckpt.manifest["world_size"] == world():
                raw = ckpt.read(f"rank-{rank():05d}.pt")
                got["rank_state"] = torch.load(io.BytesIO(raw), weights_only=True)
            return state

        ckpt = restore(self.locations(), self.run.url, prepare, step)
        self.last_restore = Restored(ckpt.step, ckpt.source, ckpt.location.url)
        log.info("restored step %d from %s", ckpt.step, ckpt.source)
        return ckpt.step, got["meta"], got["rank_state"]

    def close(self) -> None:
        """Wait for the save in flight and release the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._stager.close()
