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
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from cs3ray.config import redact_config_text
from cs3ray.errors import UserError
from cs3ray.storage import RETRY_DEADLINE_S, Storage, StorageError, is_remote, open_url

from .chunks import ChunkStore, ChunkWriter
from .dcp_metadata import plain_reader
from .locations import MemoryLocation, StorageLocation, collect, list_steps, replicate, step_dir
from .manifest import CheckpointError, write_manifest
from .staging import Stager

log = logging.getLogger(__name__)
CONFIG = "config.yaml"
# Loading or saving in one process (inference, export, tests) is intended, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _broadcast(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool) -> bool:
    """True only when `ok` is true on every rank (so every rank takes the same fallback)."""
    if not dist.is_initialized():
        return ok
    t = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(t)
    return float(t) == 0.0


def load_state(state: dict[str, Any], reader: Any) -> None:
    """dcp.load(state) in place, the reader's `.metadata` read (and checked) first; call it on every rank.

    DCP catches a failed metadata read, retries it as a per-rank file and logs both tracebacks; read
    here first (the reader keeps it), a refused or damaged `.metadata` is one CheckpointError on every
    rank. A CheckpointError the reader raises later (a damaged chunk) comes out as itself too.
    """
    problem: Exception | None = None
    try:
        reader.read_metadata()
    except UserError as exc:
        problem = exc
    except Exception as exc:  # noqa: BLE001 - e.g. a keeper gone: every rank must stop together
        problem = CheckpointError(f"cannot read the checkpoint's metadata: {type(exc).__name__}: {exc}")
    if not _all_ok(problem is None):
        raise problem or CheckpointError("another rank could not read the checkpoint's metadata.")
    try:
        dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        for err, _trace in exc.failures.values():
            if isinstance(err, UserError):
                raise err from None
        raise


def dcp_writer(folder: Storage):
    """A plain DCP writer (format-1 layout); the manager itself writes chunks."""
    if is_remote(folder.url):
        return FsspecWriter(folder.url, **folder.fs.storage_options)
    return FileSystemWriter(folder.url)


def dcp_reader(folder: Storage):
    """The reader of a plain DCP folder (format-1 layout); it runs no code from the folder's pickles."""
    return plain_reader(folder)


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
        # The async writer runs at training's priority: measured on 2 busy cores, a nice-19 writer got
        # almost no CPU during the step and left its work for when training waited on it (async cost
        # as much as sync); at equal priority it overlaps, and O_DIRECT writes keep its CPU small.
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
        # Credentials never reach the folder, its manifest's config_hash, replicas or the keepers.
        files = {k: redact_config_text(v) if k == CONFIG else v for k, v in files.items()}
        job = (step, state, json.loads(json.dumps(meta)), buf.getvalue(), files)
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
        group, rank = self._group, _rank()
        folder = self.run.child(step_dir(step))
        if rank == 0 and self.run.exists(step_dir(step)):
            folder.rm()  # an earlier attempt at this step that never got its manifest
        _barrier(group)
        writer = ChunkWriter(folder, ChunkStore(self.run), self._known if self.incremental else frozenset(), digests)
        try:
            try:
                dcp.save(state, storage_writer=writer, process_group=group)
            except CheckpointException as exc:  # a BaseException: make it an ordinary, readable error
                cause = next(iter(exc.failures.values()), exc)
                why = str(cause) if isinstance(cause, UserError) else repr(cause)
                raise CheckpointError(f"checkpoint of step {step} to '{folder.url}' failed: {why}") from None
            rank_name = f"rank-{rank:05d}.pt"
            folder.write_bytes(rank_file, rank_name, durable=False)
            small = {}
            if rank == 0:
                small = {"state.json": json.dumps(meta, indent=1, sort_keys=True).encode(),
                         **{k: v.encode() for k, v in files.items()}}
                for name, blob in small.items():
                    folder.write_bytes(blob, name, durable=False)
            if self.memory is not None:
                self.memory.push(step, writer.blobs, {rank_name: rank_file})
            self.run.sync()  # everything this rank wrote is durable before rank 0 commits the manifest
            _barrier(group)
            if rank == 0:
                self._commit(step, folder, meta, files, writer, small)
            _barrier(group)
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
        manifest = write_manifest(folder, step, _world(), {
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
        -> the previous checkpoint, saying so.
        """
        self.wait()
        locs = self.locations()
        attempts = _broadcast(self._plan(locs, step) if _rank() == 0 else None)
        problems: list[str] = []
        for s, i in attempts:
            loc = locs[i]
            manifest, problem = None, None
            if _rank() == 0:
                try:
                    manifest = loc.check(s)
                except (CheckpointError, StorageError) as exc:
                    problem = str(exc)
            manifest, problem = _broadcast((manifest, problem))
            if manifest is None:
                problems.append(problem)
                log.warning("skipping checkpoint: %s", problem)
                continue
            try:
                meta = json.loads(loc.read(s, "state.json", manifest))
                rank_state = None
                if manifest["world_size"] == _world():
                    raw = loc.read(s, f"rank-{_rank():05d}.pt", manifest)
                    rank_state = torch.load(io.BytesIO(raw), weights_only=True)
                ok = True
            except (CheckpointError, StorageError) as exc:
                ok, problem = False, str(exc)
            if _all_ok(ok):
                try:
                    load_state(state, loc.reader(s, manifest))
                except (CheckpointException, CheckpointError, StorageError) as exc:
                    ok, problem = False, str(exc).splitlines()[0][:300]
            if not ok or not _all_ok(ok):
                problems.append(problem or "another rank could not read it")
                log.warning("skipping checkpoint: %s %s: %s", loc.label, s, problem)
                continue
            source = loc.label
            if isinstance(loc, MemoryLocation) and not _all_ok(not loc.tier.peer_used):
                source = "peer"  # some rank read a copy held by another node's keeper
            self.last_restore = Restored(s, source, getattr(loc, "url", ""))
            log.info("restored step %d from %s", s, source)
            return s, meta, rank_state
        detail = f": {problems[0]}" if problems else ""
        raise CheckpointError(f"no loadable checkpoint in '{self.run.url}'{detail}")

    def _plan(self, locs: list, step: int | None) -> list[tuple[int, int]]:
        """(step, location index) pairs to try, newest step first, tiers in order within a step."""
        have = [set(loc.steps()) for loc in locs]
        primary = have[len(locs) - 1 - len(self.replicas)]
        if self.memory is not None and primary:
            # Memory commits after the primary's manifest, so a memory snapshot missing from a
            # non-empty primary belongs to an older run that used this URL.
            have[0] &= primary
        steps = [step] if step is not None else sorted(set().union(*have), reverse=True)
        return [(s, i) for s in steps for i in range(len(locs)) if s in have[i]]

    def close(self) -> None:
        """Wait for the save in flight and release the background thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            self._stager.close()
