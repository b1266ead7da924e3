"""The memory tier's keeper actor: one per node, holding the newest snapshots' chunks in the object store.

Its client side (which keeper gets which chunks, commits, restores) is cs3ray.ckpt.keeper. This
module lives outside cs3ray.ckpt and imports only numpy and Ray, so the process of a keeper, which
starts on every node of every cluster, never imports torch or DCP. The keeper `ray.put`s the
chunks itself, so it owns them and they survive the death of the worker that produced them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

NAMESPACE = "cs3ray_ckpt"
MAX_RUNS = 4  # snapshots of this many runs per keeper; the least recently saved run is dropped


class Keeper:
    """Holds chunks (by content hash) and the small files of each run's newest committed snapshot."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.blobs: dict[str, Any] = {}                  # chunk name -> ObjectRef owned by this actor
        self.snaps: dict[str, dict[int, dict]] = {}      # run -> step -> {chunks, own, files, manifest}

    def node(self) -> str:
        return self.node_id

    def missing(self, hashes: list[str]) -> list[str]:
        return [h for h in hashes if h not in self.blobs]

    def _snap(self, run: str, step: int) -> dict:
        return self.snaps.setdefault(run, {}).setdefault(
            step, {"chunks": set(), "own": set(), "files": {}, "manifest": None})

    def put(self, run: str, step: int, blobs: dict[str, Any], refs: list[str], files: dict[str, bytes],
            own: bool = True) -> None:
        """Take chunks (only those not held yet are sent) and files of one rank for (run, step).

        `own`: the rank runs on this keeper's node; otherwise these are the peer copies of a rank
        on another node.
        """
        import ray

        for h, blob in blobs.items():
            if h not in self.blobs:
                self.blobs[h] = ray.put(np.array(blob, copy=True))
        snap = self._snap(run, step)
        snap["chunks"].update(refs)
        if own:
            snap["own"].update(refs)
        snap["files"].update(files)

    def commit(self, run: str, step: int, manifest: dict, files: dict[str, bytes]) -> None:
        """Mark (run, step) complete; drop the run's other snapshots and chunks nothing references."""
        snaps = self.snaps.setdefault(run, {})
        snap = self._snap(run, step)
        snap["manifest"] = manifest
        snap["files"].update(files)
        for s in [s for s in snaps if s != step and s < step]:
            del snaps[s]
        self.snaps[run] = self.snaps.pop(run)  # most recently saved run last
        while len(self.snaps) > MAX_RUNS:
            del self.snaps[next(iter(self.snaps))]
        self._gc()

    def index(self, run: str) -> dict[int, dict]:
        """Committed snapshots of `run`: step -> (manifest, chunks held here, of those the own ones, files)."""
        return {s: {"manifest": sn["manifest"], "chunks": sorted(h for h in sn["chunks"] if h in self.blobs),
                    "own": sorted(h for h in sn["own"] if h in self.blobs), "files": sorted(sn["files"])}
                for s, sn in self.snaps.get(run, {}).items() if sn["manifest"] is not None}

    def refs(self, hashes: list[str]) -> dict[str, list]:
        # Wrapped in a list so the caller receives the reference, not the value.
        return {h: [self.blobs[h]] for h in hashes if h in self.blobs}

    def files(self, run: str, step: int) -> dict[str, bytes]:
        return dict(self.snaps.get(run, {}).get(step, {}).get("files", {}))

    def drop(self, run: str) -> None:
        """Forget every snapshot of `run`."""
        self.snaps.pop(run, None)
        self._gc()

    def _gc(self) -> None:
        live = {h for steps in self.snaps.values() for sn in steps.values() for h in sn["chunks"]}
        for h in [h for h in self.blobs if h not in live]:
            del self.blobs[h]
