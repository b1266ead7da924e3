"""The memory tier: one keeper actor per node holds the newest snapshot's chunks in the object store.

Each rank hands its chunks to the keeper of its own node and to the keeper of one other node
(the next alive node in id order), so a restarted group finds every shard in memory even when
one node is gone. Keepers are detached actors: they outlive the worker group that a failure
or resize restarts. The keeper `ray.put`s the chunks itself, so it owns them and they survive
the death of the worker that produced them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .chunks import digest
from .manifest import CheckpointError

log = logging.getLogger(__name__)
NAMESPACE = "cs3ray_ckpt"
MAX_RUNS = 4  # snapshots of this many runs per keeper; the least recently saved run is dropped


class Keeper:
    """Holds chunks (by sha256) and the small files of each run's newest committed snapshot."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.blobs: dict[str, Any] = {}                  # sha256 -> ObjectRef owned by this actor
        self.snaps: dict[str, dict[int, dict]] = {}      # run -> step -> {chunks, files, manifest}

    def node(self) -> str:
        return self.node_id

    def missing(self, hashes: list[str]) -> list[str]:
        return [h for h in hashes if h not in self.blobs]

    def put(self, run: str, step: int, blobs: dict[str, Any], refs: list[str], files: dict[str, bytes]) -> None:
        """Take chunks (only those not held yet are sent) and files of one rank for (run, step)."""
        import ray

        for h, blob in blobs.items():
            if h not in self.blobs:
                self.blobs[h] = ray.put(np.array(blob, copy=True))
        snap = self.snaps.setdefault(run, {}).setdefault(step, {"chunks": set(), "files": {}, "manifest": None})
        snap["chunks"].update(refs)
        snap["files"].update(files)

    def commit(self, run: str, step: int, manifest: dict, files: dict[str, bytes]) -> None:
        """Mark (run, step) complete; drop the run's other snapshots and chunks nothing references."""
        snaps = self.snaps.setdefault(run, {})
        snap = snaps.setdefault(step, {"chunks": set(), "files": {}, "manifest": None})
        snap["manifest"] = manifest
        snap["files"].update(files)
        for s in [s for s in snaps if s != step and s < step]:
            del snaps[s]
        self.snaps[run] = self.snaps.pop(run)  # most recently saved run last
        while len(self.snaps) > MAX_RUNS:
            del self.snaps[next(iter(self.snaps))]
        self._gc()

    def index(self, run: str) -> dict[int, dict]:
        """Committed snapshots of `run`: step -> (manifest, chunks held here, files held here)."""
        return {s: {"manifest": sn["manifest"], "chunks": sorted(h for h in sn["chunks"] if h in self.blobs),
                    "files": sorted(sn["files"])}
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


def alive_nodes() -> list[str]:
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def keeper(node_id: str):
    """The keeper actor of `node_id`, started there on first use."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, max_restarts=0)(Keeper)
    return cls.options(name=f"keeper-{node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


class MemoryTier:
    """A rank's view of the keepers: push this rank's chunks, commit, and read snapshots back."""

    def __init__(self, run: str) -> None:
        import ray

        self.run = run
        self.node_id = ray.get_runtime_context().get_node_id()
        self.peer_used = False

    def _targets(self) -> list[str]:
        nodes = alive_nodes()
        if self.node_id not in nodes:
            return nodes[:1]
        i = nodes.index(self.node_id)
        return [self.node_id] + ([nodes[(i + 1) % len(nodes)]] if len(nodes) > 1 else [])

    def push(self, step: int, blobs: dict[str, Any], files: dict[str, bytes]) -> None:
        """Hand this rank's chunks and files to its node's keeper and one other node's keeper."""
        import ray

        keepers = [keeper(n) for n in self._targets()]
        missing = ray.get([k.missing.remote(list(blobs)) for k in keepers])
        ray.get([k.put.remote(self.run, step, {h: blobs[h] for h in miss}, list(blobs), files)
                 for k, miss in zip(keepers, missing)])

    def commit(self, step: int, manifest: dict, files: dict[str, bytes]) -> None:
        """Rank 0, after every rank pushed: make the snapshot visible on every alive node's keeper."""
        import ray

        ray.get([keeper(n).commit.remote(self.run, step, manifest, files) for n in alive_nodes()])

    def _indexes(self) -> list[tuple[str, Any, dict]]:
        import ray

        out = []
        for n in alive_nodes():
            k = keeper(n)
            try:
                out.append((n, k, ray.get(k.index.remote(self.run), timeout=30)))
            except Exception as exc:  # noqa: BLE001 - a lost keeper is a memory miss, not an error
                log.warning("keeper on node %s unreachable: %s", n[:8], exc)
        return out

    def steps(self) -> dict[int, dict]:
        """step -> manifest of snapshots whose every chunk and file some alive keeper holds."""
        found: dict[int, dict] = {}
        for _, _, index in self._indexes():
            for s, entry in index.items():
                slot = found.setdefault(s, {"manifest": entry["manifest"], "chunks": set(), "files": set()})
                slot["chunks"].update(entry["chunks"])
                slot["files"].update(entry["files"])
        complete = {}
        for s, slot in found.items():
            m = slot["manifest"]
            if set(m.get("chunks", {})) <= slot["chunks"] and set(m["files"]) <= slot["files"]:
                complete[s] = m
        return complete

    def file(self, step: int, name: str) -> bytes:
        import ray

        for _, k, index in self._indexes():
            if name in index.get(step, {}).get("files", []):
                return ray.get(k.files.remote(self.run, step))[name]
        raise CheckpointError(f"memory snapshot {step} of '{self.run}' has no '{name}'.")

    def fetcher(self, step: int):
        """fetch(h) -> verified chunk bytes from the keepers (this node's first)."""
        import ray

        where: dict[str, list] = {}
        indexes = sorted(self._indexes(), key=lambda e: e[0] != self.node_id)
        for n, k, index in indexes:
            for h in index.get(step, {}).get("chunks", []):
                where.setdefault(h, []).append((n, k))

        def fetch(h: str) -> Any:
            for n, k in where.get(h, []):
                try:
                    ref = ray.get(k.refs.remote([h]))[h][0]
                    blob = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - try the copy on the other node
                    log.warning("chunk %s from keeper %s failed: %s", h[:12], n[:8], exc)
                    continue
                if digest(blob) == h:
                    self.peer_used |= n != self.node_id
                    return blob
            raise CheckpointError(f"memory snapshot {step}: chunk {h[:12]} is not held intact by any keeper.")

        return fetch
