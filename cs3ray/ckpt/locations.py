"""Where a checkpoint can be restored from: the primary run dir, a replica, or the memory tier.

Each location answers the same questions (which steps, check one, read a verified file, a
DCP reader), so the fallback memory -> primary -> replica -> previous is one loop (see restore),
the trainer's and every reader's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re

from cs3ray.storage import Storage, StorageError, short_error

from .chunks import METADATA, ChunkReader, ChunkStore
from .dcp_metadata import plain_reader
from .keeper import MemoryTier
from .manifest import MANIFEST, CheckpointError, read_manifest, verify

log = logging.getLogger(__name__)
STEP_RE = re.compile(r"^step-(\d{8})$")


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def list_steps(run: Storage) -> list[int]:
    """Steps of complete checkpoints (a manifest present), oldest first."""
    steps = []
    for name in run.ls():
        m = STEP_RE.match(name)
        if m and run.exists(name, MANIFEST):
            steps.append(int(m.group(1)))
    return sorted(steps)


def checked(blob: bytes, manifest: dict, name: str, where: str) -> bytes:
    """`blob` if it matches the manifest's size and sha256 for `name`, else CheckpointError."""
    meta = manifest["files"].get(name)
    if meta is None:
        raise CheckpointError(f"checkpoint '{where}' lists no '{name}'.")
    if len(blob) != meta["size"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise CheckpointError(f"checkpoint file '{where}/{name}' does not match its checksum (corrupt or truncated).")
    return blob


class StorageLocation:
    """A run directory on any fsspec URL (the primary, or a replica)."""

    def __init__(self, run: Storage, label: str = "storage") -> None:
        self.run, self.label = run, label
        self.store = ChunkStore(run)

    @property
    def url(self) -> str:
        return self.run.url

    def steps(self) -> list[int]:
        try:
            return list_steps(self.run)
        except StorageError as exc:
            log.warning("%s '%s' unreachable: %s", self.label, self.run.url, exc)
            return []
        except Exception as exc:  # noqa: BLE001 - a backend's own error, e.g. botocore's NoCredentialsError
            log.warning("%s '%s' unreachable: %s", self.label, self.run.url, short_error(exc))
            return []

    def folder(self, step: int) -> Storage:
        return self.run.child(step_dir(step))

    def checkpoint_url(self, step: int) -> str:
        return self.folder(step).url

    def check(self, step: int, deep: bool = False) -> dict:
        """Verify the folder's files (sha256) and that every chunk is there with its size.

        Chunk contents are hashed when read (they are named by their hash); `deep` hashes them now.
        """
        manifest = verify(self.folder(step))
        chunks = manifest.get("chunks")
        if chunks:
            have = self.store.sizes()
            for h, size in chunks.items():
                if have.get(h) != size:
                    raise CheckpointError(f"checkpoint '{self.folder(step).url}' is missing chunk {h[:12]} "
                                          f"(or it has the wrong size).")
                if deep:
                    self.store.get(h)
        return manifest

    def read(self, step: int, name: str, manifest: dict) -> bytes:
        folder = self.folder(step)
        try:
            blob = folder.read_bytes(name)
        except StorageError as exc:
            raise CheckpointError(str(exc)) from None
        return checked(blob, manifest, name, folder.url)

    def reader(self, step: int, manifest: dict):
        if "chunks" in manifest:
            return ChunkReader(lambda: self.read(step, METADATA, manifest), self.store.get,
                               where=f"{self.folder(step).url}/{METADATA}")
        # A format-1 checkpoint of plain DCP files, verified whole by check().
        return plain_reader(self.folder(step))


class MemoryLocation:
    """The newest snapshots held by the keeper actors (see keeper.py)."""

    label = "memory"

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self._steps: dict[int, dict] | None = None

    @property
    def url(self) -> str:
        return f"memory:{self.tier.run}"

    def snapshots(self) -> dict[int, dict]:
        if self._steps is None:
            try:
                self._steps = self.tier.steps()
            except Exception as exc:  # noqa: BLE001 - no keepers: a memory miss
                log.warning("memory tier unavailable: %s", exc)
                self._steps = {}
        return self._steps

    def steps(self) -> list[int]:
        return sorted(self.snapshots())

    def checkpoint_url(self, step: int) -> str:
        return f"{self.url}/{step_dir(step)}"

    def check(self, step: int, deep: bool = False) -> dict:
        manifest = self.snapshots().get(step)
        if manifest is None:
            raise CheckpointError(f"no complete memory snapshot of step {step}.")
        return manifest

    def read(self, step: int, name: str, manifest: dict) -> bytes:
        return checked(self.tier.file(step, name), manifest, name, self.url)

    def reader(self, step: int, manifest: dict):
        fetch = self.tier.fetcher(step, manifest["chunks"])
        return ChunkReader(lambda: self.read(step, METADATA, manifest), fetch, fetch.prefetch,
                           where=f"{self.url}/{step_dir(step)}/{METADATA}")


def restore_order(locs: list, step: int | None = None) -> list[tuple[int, int]]:
    """(step, index into `locs`) to try: newest step first (only `step` when given), then `locs`' order.

    `locs` is memory (optional), the primary, then replicas. A memory snapshot of a step that a
    non-empty primary lacks belongs to an older run that used this URL (memory commits after the
    primary's manifest), so it is not a candidate.
    """
    have = [set(loc.steps()) for loc in locs]
    primary = next(i for i, loc in enumerate(locs) if not isinstance(loc, MemoryLocation))
    if have[primary]:
        have = [h & have[primary] if isinstance(loc, MemoryLocation) else h
                for h, loc in zip(have, locs, strict=True)]
    steps = [step] if step is not None else sorted(set().union(*have), reverse=True)
    return [(s, i) for s in steps for i in range(len(locs)) if s in have[i]]


def replicate(src: StorageLocation, dst: StorageLocation, step: int, manifest: dict) -> None:
    """Copy one checkpoint (its files, then its missing chunks, the manifest last) to a replica."""
    have = dst.store.sizes()
    for h, size in manifest.get("chunks", {}).items():
        if have.get(h) != size:
            dst.store.put(h, src.store.get(h))
    folder = dst.folder(step)
    for name in manifest["files"]:
        folder.write_bytes(src.read(step, name, manifest), name, durable=False)
    dst.run.sync()
    folder.write_text(json.dumps(manifest, indent=1, sort_keys=True), MANIFEST)


def collect(loc: StorageLocation, keep: int, sweep: bool = True) -> dict[str, int]:
    """Keep the newest `keep` checkpoints; drop older folders, stale partial ones, unreferenced chunks.

    A chunk is deleted only when no remaining complete manifest lists it, so GC never breaks
    a kept checkpoint. With `sweep` every stored chunk is listed and checked, which also finds
    the orphans of a save that failed half-way; without it only the chunks of the folders
    dropped now are candidates (listing every chunk of a large run on each save costs a
    stored-object listing, and measurably CPU on the training host). A dropped folder whose
    manifest cannot be read turns a sweep on. Returns {"folders": n, "chunks": n} deleted.
    """
    steps = loc.steps()
    kept = set(steps[-keep:])
    newest = steps[-1] if steps else -1
    removed = {"folders": 0, "chunks": 0}
    candidates: set[str] = set()
    for name in loc.run.ls():
        m = STEP_RE.match(name)
        if m and int(m.group(1)) not in kept and int(m.group(1)) <= newest:
            if not sweep:
                try:
                    candidates.update(read_manifest(loc.folder(int(m.group(1)))).get("chunks", {}))
                except (CheckpointError, StorageError):
                    sweep = True  # a partial or damaged folder: its chunks are only found by listing
            loc.run.child(name).rm()
            removed["folders"] += 1
    live: set[str] = set()
    for s in sorted(kept):
        live.update(read_manifest(loc.folder(s)).get("chunks", {}))
    for h in sorted((set(loc.store.sizes()) if sweep else candidates) - live):
        loc.store.delete(h)
        removed["chunks"] += 1
    return removed


def open_folder(folder: Storage, deep: bool = False) -> tuple[StorageLocation, int, dict]:
    """(location of its run, step, verified manifest) of one checkpoint folder."""
    manifest = read_manifest(folder)
    parent = Storage(folder.url.rstrip("/").rsplit("/", 1)[0], folder.options)
    loc = StorageLocation(parent)
    step = int(manifest["step"])
    if loc.folder(step).url.rstrip("/") != folder.url.rstrip("/"):
        raise CheckpointError(f"'{folder.url}' is not named {step_dir(step)} as its manifest says.")
    return loc, step, loc.check(step, deep=deep)
