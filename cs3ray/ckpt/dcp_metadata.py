"""Read what DCP stores as pickles, `.metadata` and non-tensor entries, without running code from it.

`.metadata` is a pickle of DCP's Metadata, and a plain unpickle calls whatever the bytes name, so
a crafted file would run code when its checkpoint loads; the manifest's sha256 only proves the
bytes are the ones listed, not who wrote them. Here the unpickler admits only the classes DCP
metadata consists of (recorded from our checkpoints of every strategy and precision, chunked and
plain DCP folders), DCP's own folder readers are given the same unpickler, and a non-tensor entry
(which DCP's planner loads with torch.load(weights_only=False)) must first load with weights_only.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from cs3ray.names import check_hex, check_name
from cs3ray.storage import Storage, is_remote

from .manifest import CheckpointError

_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where a plain DCP folder keeps each item
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout's name -> torch.strided etc.
    # StorageMeta.checkpoint_id of a plain DCP folder is the path it was saved to.
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("set", "frozenset", "bytearray", "complex")),
})
# torch.float32, torch.strided, torch.contiguous_format ...: values, not callables that do anything.
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise _Refused(module, name)


def load_metadata(blob: bytes, where: str) -> Metadata:
    """DCP Metadata from `.metadata` bytes, admitting only its own classes; CheckpointError naming `where` else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
    except _Refused as exc:
        raise CheckpointError(f"checkpoint file '{where}' refers to {exc.qualname}, which DCP metadata never "
                              "holds; refusing to load it, since unpickling it could run code.") from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a damaged file
        raise CheckpointError(f"checkpoint file '{where}' is not DCP metadata ({type(exc).__name__}: {exc}).") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file '{where}' holds a {type(metadata).__name__}, not DCP metadata.")
    if not isinstance(metadata.storage_data or {}, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"checkpoint file '{where}' is not DCP metadata (its entries are not mappings).")
    for info in (metadata.storage_data or {}).values():
        _check_item(info, where)
    return metadata


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def item_dtype(name: object) -> torch.dtype | None:
    """The torch dtype a chunked `.metadata` item names ("torch.float32"), or None when it names none."""
    found = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) and name.isascii() else None
    return found if isinstance(found, torch.dtype) else None


def item_nbytes(info: dict) -> int:
    """The bytes a tensor item of a chunked `.metadata` claims: its shape times its dtype's size."""
    n = item_dtype(info["dtype"]).itemsize  # type: ignore[union-attr] - checked by _check_item
    for d in info["shape"]:
        n *= d
    return n


def _check_item(info: object, where: str) -> None:
    """Where one item is stored: a plain DCP file (a name in the folder) or one of our chunks (an id, a tensor's
    dtype and shape); refused before any of it becomes a path."""
    if isinstance(info, _StorageInfo):
        check_name(info.relative_path, f"checkpoint file '{where}'", CheckpointError)
        if not _count(info.offset) or not _count(info.length):
            raise CheckpointError(f"checkpoint file '{where}' places an item at offset {info.offset!r}, length "
                                  f"{info.length!r}: not byte counts.")
        return
    if not isinstance(info, dict):
        raise CheckpointError(f"checkpoint file '{where}' stores an item as a {type(info).__name__}, which neither "
                              "cs3ray nor DCP writes.")
    check_hex(info.get("chunk"), f"checkpoint file '{where}'", CheckpointError)
    if info.get("kind") == "bytes":
        return
    shape = info.get("shape")
    if item_dtype(info.get("dtype")) is None or not isinstance(shape, list) or not all(map(_count, shape)):
        raise CheckpointError(f"checkpoint file '{where}' describes chunk {info['chunk'][:12]} with dtype "
                              f"{info.get('dtype')!r} and shape {shape!r}, which are not a tensor's.")


def check_sizes(metadata: Metadata, manifest: dict, where: str) -> None:
    """Every tensor `.metadata` declares fits in the bytes the (verified) manifest says are stored for it.

    Run before tensors are allocated from the declared sizes (export), so a crafted `.metadata` cannot claim
    a tensor larger than its checkpoint.
    """
    chunks, files = manifest.get("chunks") or {}, manifest.get("files") or {}
    stored: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(info, _StorageInfo):
            size = (files.get(info.relative_path) or {}).get("size", 0)
            if info.offset + info.length > size:
                raise CheckpointError(f"checkpoint file '{where}' places an item at bytes {info.offset}..."
                                      f"{info.offset + info.length} of '{info.relative_path}', which holds {size}.")
            n = info.length
        else:
            n = chunks.get(info["chunk"], 0)
        fqn = getattr(index, "fqn", None)
        stored[fqn] = stored.get(fqn, 0) + n
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype, size = getattr(md.properties, "dtype", None), md.size
        if not isinstance(dtype, torch.dtype) or not isinstance(size, (tuple, list)) or not all(map(_count, size)):
            raise CheckpointError(f"checkpoint file '{where}' declares tensor '{fqn}' with dtype {dtype!r} and "
                                  f"size {size!r}, which are not a tensor's.")
        claimed = dtype.itemsize
        for d in size:
            claimed *= d
        if claimed > stored.get(fqn, 0):
            raise CheckpointError(f"checkpoint file '{where}' declares tensor '{fqn}' of shape {tuple(md.size)} "
                                  f"({claimed} bytes), more than the {stored.get(fqn, 0)} bytes stored for it.")


class _PlainDataBytes:
    """A load planner whose non-tensor entries must load with torch.load(weights_only=True) first."""

    def __init__(self, planner: LoadPlanner, where: str) -> None:
        self._planner, self._where = planner, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raw = value.read()
        try:
            torch.load(io.BytesIO(raw), weights_only=True)
        except Exception:  # noqa: BLE001 - whatever torch's restricted unpickler refused
            raise CheckpointError(f"checkpoint entry '{read_item.dest_index.fqn}' in '{self._where}' is not data "
                                  "that torch.load(weights_only=True) accepts; refusing to load it, since "
                                  "unpickling it could run code.") from None
        self._planner.load_bytes(read_item, io.BytesIO(raw))


def guard_planner(planner: LoadPlanner, where: str) -> LoadPlanner:
    """`planner`, with non-tensor entries checked by torch's weights_only unpickler before DCP loads them."""
    return _PlainDataBytes(planner, where)  # type: ignore[return-value]


class _SafeMetadata:
    """read_metadata/read_data of DCP's folder readers, through the restricted unpicklers above."""

    path: Any
    fs: Any
    load_id: str
    _read: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._read is not None:  # read once (load_state reads it before DCP does)
            return self._read
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._read = metadata
        return metadata

    def reset(self, checkpoint_id: Any = None) -> None:
        self._read = None
        super().reset(checkpoint_id)  # type: ignore[misc]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, guard_planner(planner, str(self.path)))  # type: ignore[misc]


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's FileSystemReader (a plain, format-1 folder on a local path), read without running code."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's FsspecReader (a plain, format-1 folder at a URL), read without running code."""


def plain_reader(folder: Storage) -> FileSystemReader:
    """The reader of a plain (format-1) DCP folder, local or at a URL."""
    if is_remote(folder.url):
        return SafeFsspecReader(folder.url, **folder.fs.storage_options)
    return SafeFileSystemReader(folder.url)
