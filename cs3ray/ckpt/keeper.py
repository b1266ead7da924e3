"""The memory tier: one keeper actor per node holds the newest snapshot's chunks in the object store.

Each rank hands its chunks to the keeper of its own node and to the keeper of one other node
(the next alive node in id order), so a restarted group finds every shard in memory even when
one node is gone; a restore that needed such a peer copy says "peer". Keepers are detached
actors: they outlive the worker group that a failure or resize restarts. The actor itself is
cs3ray.keeper, outside this package, so that its process imports neither torch nor DCP.

Chunks are named by the content hash (XXH3-128) of their bytes, and a restore from memory
checks every chunk against its name exactly as a restore from storage does: a chunk that does
not match is read from its other keeper, and failing that the restore falls back to storage
(the small files, `.metadata` included, are checked against the manifest's sha256).
"""

from __future__ import annotations

import logging
from typing import Any

from cs3ray.keeper import NAMESPACE, Keeper

from .chunks import matches
from .manifest import CheckpointError

log = logging.getLogger(__name__)


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


def start_keepers() -> None:
    """Ask for every alive node's keeper now without waiting for it: the driver calls this as a
    run starts, so the keepers come up while Ray Train starts its workers, not after."""
    for node in alive_nodes():
        keeper(node)


class MemoryTier:
    """A rank's view of the keepers: push this rank's chunks, commit, and read snapshots back.

    `steps()` asks every alive keeper for its index once (in parallel); `file` and `fetcher`
    reuse that answer, so a restore costs one round of index calls, one of file calls and one
    batched reference lookup per keeper.
    """

    def __init__(self, run: str) -> None:
        import ray

        self.run = run
        self.node_id = ray.get_runtime_context().get_node_id()
        self.peer_used = False
        self._seen: list[tuple[str, Any, dict]] | None = None   # (node, keeper, index) of the last steps()
        self._files: dict[int, dict[str, bytes]] = {}

    def _targets(self) -> list[str]:
        nodes = alive_nodes()
        if self.node_id not in nodes:
            return nodes[:1]
        i = nodes.index(self.node_id)
        return [self.node_id] + ([nodes[(i + 1) % len(nodes)]] if len(nodes) > 1 else [])

    def push(self, step: int, blobs: dict[str, Any], files: dict[str, bytes]) -> None:
        """Hand this rank's chunks and files to its node's keeper and one other node's keeper."""
        import ray

        targets = self._targets()
        keepers = [keeper(n) for n in targets]
        missing = ray.get([k.missing.remote(list(blobs)) for k in keepers])
        ray.get([k.put.remote(self.run, step, {h: blobs[h] for h in miss}, list(blobs), files, n == self.node_id)
                 for n, k, miss in zip(targets, keepers, missing, strict=True)])

    def commit(self, step: int, manifest: dict, files: dict[str, bytes]) -> None:
        """Rank 0, after every rank pushed: make the snapshot visible on every alive node's keeper."""
        import ray

        ray.get([keeper(n).commit.remote(self.run, step, manifest, files) for n in alive_nodes()])

    def _indexes(self) -> list[tuple[str, Any, dict]]:
        import ray

        asked = [(n, k, k.index.remote(self.run)) for n in alive_nodes() for k in [keeper(n)]]
        out = []
        for n, k, ref in asked:
            try:
                out.append((n, k, ray.get(ref, timeout=30)))
            except Exception as exc:  # noqa: BLE001 - a lost keeper is a memory miss, not an error
                log.warning("keeper on node %s unreachable: %s", n[:8], exc)
        self._seen, self._files = out, {}
        return out

    def _known(self, step: int) -> list[tuple[str, Any, dict]]:
        """The indexes of the last `steps()`, asked again when they do not know `step`."""
        if self._seen is None or not any(step in index for _, _, index in self._seen):
            return self._indexes()
        return self._seen

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

        if name not in self._files.get(step, {}):
            for _, k, index in self._known(step):
                if name in index.get(step, {}).get("files", []):
                    self._files[step] = ray.get(k.files.remote(self.run, step))
                    break
        if name not in self._files.get(step, {}):
            raise CheckpointError(f"memory snapshot {step} of '{self.run}' has no '{name}'.")
        return self._files[step][name]

    def fetcher(self, step: int, sizes: dict[str, int]) -> "Fetcher":
        """Reads chunks of snapshot `step` from the keepers (see Fetcher); resets `peer_used`."""
        self.peer_used = False
        where: dict[str, list[tuple[bool, str, Any]]] = {}
        for n, k, index in self._known(step):
            entry = index.get(step, {})
            own = set(entry.get("own", entry.get("chunks", [])))
            for h in entry.get("chunks", []):
                where.setdefault(h, []).append((h in own, n, k))
        for holders in where.values():
            holders.sort(key=lambda c: (not c[0], c[1] != self.node_id))
        return Fetcher(self, step, sizes, where)


class Fetcher:
    """fetch(h) -> chunk bytes that hash to their name `h`, from the keepers.

    Each chunk comes from a keeper holding it as its own node's copy when one is alive (this
    node's first), else from a peer copy (then the tier's `peer_used`). `prefetch` gets the
    chunks a rank will read in one batch (one reference lookup per keeper, one `ray.get`); a
    chunk whose copy fails or does not match its hash is tried at its other holders.
    """

    def __init__(self, tier: MemoryTier, step: int, sizes: dict[str, int],
                 where: dict[str, list[tuple[bool, str, Any]]]) -> None:
        self.tier, self.step, self.sizes, self.where = tier, step, sizes, where
        self.got: dict[str, Any] = {}

    def _intact(self, h: str, blob: Any, node: str) -> bool:
        if len(blob) != self.sizes.get(h):
            return False
        if not matches(blob, h):
            log.warning("memory snapshot %d: chunk %s from keeper %s does not match its checksum (corrupt)",
                        self.step, h[:12], node[:8])
            return False
        return True

    def prefetch(self, hashes: list[str]) -> None:
        import ray

        by_keeper: dict[str, tuple[Any, list[str]]] = {}
        for h in hashes:
            if self.where.get(h):
                _, n, k = self.where[h][0]
                by_keeper.setdefault(n, (k, []))[1].append(h)
        try:
            refs = {h: r[0] for answer in ray.get([k.refs.remote(hs) for k, hs in by_keeper.values()])
                    for h, r in answer.items()}
            self.got.update(zip(refs, ray.get(list(refs.values())), strict=True))
        except Exception as exc:  # noqa: BLE001 - some copy is gone: chunk by chunk from here on
            log.warning("memory snapshot %d: batched read failed (%s); reading chunk by chunk", self.step, exc)

    def __call__(self, h: str) -> Any:
        import ray

        blob = self.got.pop(h, None)
        if blob is not None and self._intact(h, blob, self.where[h][0][1]):
            self.tier.peer_used |= not self.where[h][0][0]
            return blob
        for own, n, k in self.where.get(h, []):
            try:
                blob = ray.get(ray.get(k.refs.remote([h]))[h][0])
            except Exception as exc:  # noqa: BLE001 - try the copy on the other node
                log.warning("chunk %s from keeper %s failed: %s", h[:12], n[:8], exc)
                continue
            if self._intact(h, blob, n):
                self.tier.peer_used |= not own
                return blob
        raise CheckpointError(f"memory snapshot {self.step}: chunk {h[:12]} is not held intact by any keeper.")
