"""Content-addressed tensor chunks, and the DCP StorageWriter/Reader that store checkpoints in them.

Every DCP write item (a tensor shard or a bytes object) becomes one chunk named by the
XXH3-128 hash of its raw bytes, under <run>/chunks/<2 hex>/<32 hex>. A chunk that the previous
checkpoint already wrote is referenced, not rewritten, so a fine-tune with frozen layers
writes little more than what changed. The step folder's `.metadata` maps each item to its
chunk (builtins only), and the reader checks every chunk's hash before it is used.

Why XXH3-128 and not sha256 (which the manifest keeps for the step folder's own files): the
name is both the dedup key and the checksum that catches damaged bytes, and a save hashes
every byte of the state each time, and XXH3-128 is many times faster (figures:
docs/benchmarks.md); on a CPU host that time is taken from training. A
128-bit hash makes an accidental collision among a run's chunks vanishingly unlikely; the
chunk store guards against damage, not against someone who can write to it (who could
rewrite the manifests as well). Chunks named by sha256 (64 hex digits, format 1) still load.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import posixpath
import warnings
from typing import Any, Callable

import numpy as np
import torch
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from cs3ray.names import check_hex
from cs3ray.storage import Storage, StorageError

from .dcp_metadata import guard_planner, item_nbytes, load_metadata
from .manifest import CheckpointError

METADATA = ".metadata"


def digest(blob: Any) -> str:
    """A chunk's name: the XXH3-128 of its bytes, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(memoryview(blob))


def matches(blob: Any, name: str) -> bool:
    """Whether `blob` hashes to the chunk name `name` (64 hex digits: a format-1 sha256 name)."""
    if len(name) == 64:
        return hashlib.sha256(memoryview(blob)).hexdigest() == name
    return digest(blob) == name


def tensor_blob(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a CPU tensor as a uint8 array (a view: no copy for contiguous tensors)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)


def blob_key(blob: np.ndarray) -> tuple[int, int]:
    """Where a blob's bytes live, (address, size): how the writer finds the hash staging computed."""
    return int(blob.ctypes.data), int(blob.nbytes)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src. Contiguous CPU tensors of one dtype take a one-thread memcpy: torch's threaded
    copy stalls when another process holds one of the cores (figures: docs/benchmarks.md)."""
    if (src.device.type == "cpu" and dst.device.type == "cpu" and src.dtype == dst.dtype and src.numel()
            and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous()
            and not hasattr(src, "device_mesh") and not hasattr(dst, "device_mesh")):
        np.copyto(tensor_blob(dst), tensor_blob(src))
    else:
        dst.copy_(src, non_blocking=src.is_cuda)


def blob_tensor(blob: Any, dtype: str, shape: list[int]) -> torch.Tensor:
    raw = np.frombuffer(memoryview(blob), dtype=np.uint8)
    with warnings.catch_warnings():  # read-only buffers are fine: the result is only copied from
        warnings.simplefilter("ignore")
        t = torch.from_numpy(raw) if raw.size else torch.zeros(0, dtype=torch.uint8)
    return t.view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape)


class ChunkStore:
    """The chunk folder of one run: put/get by content hash, listing and deletion for GC."""

    def __init__(self, run: Storage) -> None:
        self.root = run.child("chunks")

    def name(self, h: str) -> tuple[str, str]:
        """(folder, file) of chunk `h`; an id that is not hex is refused before it becomes a path."""
        check_hex(h, f"a chunk id for '{self.root.url}'", CheckpointError)
        return h[:2], h

    def put(self, h: str, blob: Any) -> None:
        """Store a chunk; not yet durable: the save syncs the run's storage once before its manifest."""
        self.root.write_bytes(blob, *self.name(h), durable=False)

    def get(self, h: str) -> bytes:
        """A chunk's bytes, after checking they still hash to its name."""
        try:
            blob = self.root.read_bytes(*self.name(h))
        except StorageError as exc:
            raise CheckpointError(f"chunk {h[:12]} is missing: {exc}") from None
        if not matches(blob, h):
            raise CheckpointError(f"chunk '{self.root.url}/{h[:2]}/{h}' does not match its checksum (corrupt).")
        return blob

    def sizes(self) -> dict[str, int]:
        """Every stored chunk and its size (one listing)."""
        fs, root = self.root.fs, self.root.path()
        if not self.root.exists():
            return {}
        found = self.root.call(lambda: fs.find(root, detail=True), action="list")
        return {posixpath.basename(path): int(info.get("size") or 0) for path, info in found.items()
                if len(posixpath.basename(path)) in (32, 64) and ".tmp-" not in path}

    def delete(self, h: str) -> None:
        """Remove a chunk; one that is already gone counts as removed (GC may meet it twice)."""
        self.root.rm(*self.name(h), missing_ok=True)


class ChunkWriter(StorageWriter):
    """DCP writer: each item to a content-addressed chunk, `.metadata` into the step folder."""

    def __init__(self, folder: Storage, store: ChunkStore, known: set[str] | frozenset = frozenset(),
                 digests: dict[tuple[int, int], str] | None = None) -> None:
        super().__init__()
        self.folder, self.store, self.known = folder, store, known
        self.digests = digests or {}         # hashes computed while staging, by blob_key
        self.blobs: dict[str, Any] = {}      # this rank's chunks (for the memory tier)
        self.chunks: dict[str, int] = {}     # every chunk of the checkpoint (coordinator, after finish)
        self.new_bytes = 0                   # bytes all ranks newly wrote (coordinator, after finish)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = np.frombuffer(data.getvalue(), dtype=np.uint8)
                info: dict[str, Any] = {"kind": "bytes"}
            else:
                tensor = data.detach().cpu()
                blob = tensor_blob(tensor)
                info = {"kind": "tensor", "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
            h = self.digests.get(blob_key(blob)) or digest(blob)
            new = h not in self.known and h not in self.blobs
            if new:
                self.store.put(h, blob)
            self.blobs[h] = blob
            info.update(chunk=h, size=int(blob.nbytes), new=new)
            results.append(WriteResult(index=item.index, size_in_bytes=int(blob.nbytes), storage_data=info))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        for rank_results in results:
            for wr in rank_results:
                storage[wr.index] = wr.storage_data
                self.chunks[wr.storage_data["chunk"]] = wr.storage_data["size"]
                self.new_bytes += wr.storage_data["size"] if wr.storage_data["new"] else 0
        metadata.storage_data = storage
        self.folder.write_bytes(pickle.dumps(metadata), METADATA, durable=False)

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class ChunkReader(StorageReader):
    """DCP reader over chunks: `metadata()` gives verified `.metadata` bytes, `fetch(h)` verified chunks.

    `prefetch(hashes)`, when given, is told every chunk this rank's plan reads before the first fetch.
    """

    def __init__(self, metadata: Callable[[], bytes], fetch: Callable[[str], Any],
                 prefetch: Callable[[list[str]], None] | None = None, where: str = METADATA) -> None:
        super().__init__()
        self._metadata, self.fetch, self.prefetch = metadata, fetch, prefetch
        self.where = where  # the `.metadata` file's URL, for errors
        self._read: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._read is None:  # read once (load_state reads it before DCP does)
            # Checked against the manifest's sha256, then unpickled admitting DCP's metadata classes only.
            metadata = load_metadata(self._metadata(), self.where)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._read = metadata
        return self._read

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        planner = guard_planner(planner, self.where)
        by_chunk: dict[str, list] = {}
        for req in plan.items:
            by_chunk.setdefault(self.storage_data[req.storage_index]["chunk"], []).append(req)
        if self.prefetch is not None:
            self.prefetch(list(by_chunk))
        for h, reqs in by_chunk.items():
            blob = self.fetch(h)  # each chunk is fetched (and hash-checked) once
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(memoryview(blob).tobytes()))
                    continue
                if memoryview(blob).nbytes != item_nbytes(info):  # checked before any tensor is made from it
                    raise CheckpointError(f"'{self.where}' says chunk {h[:12]} holds a {info['dtype']} tensor of shape "
                                          f"{tuple(info['shape'])}, but it holds {memoryview(blob).nbytes} bytes.")
                tensor = narrow_tensor_by_index(blob_tensor(blob, info["dtype"], info["shape"]),
                                                req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(f"checkpoint tensor {req.storage_index.fqn} has shape {tuple(tensor.size())}, "
                                          f"the model expects {tuple(target.size())}.")
                copy_into(target, tensor)
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
