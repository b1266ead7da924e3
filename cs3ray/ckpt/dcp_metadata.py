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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

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
    return metadata


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
