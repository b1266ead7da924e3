"""A checkpoint's model tensors one at a time, for readers that must never hold the whole model (hf export).

A tensor stored as one chunk (any checkpoint saved by one rank, replicated strategies) comes back as a
read-only view of the chunk's verified bytes, with no copy; one split over ranks' chunks is assembled
from them, a chunk at a time. Format-1 checkpoints (plain DCP files) load the tensor through DCP.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .chunks import ChunkReader, blob_tensor
from .dcp_metadata import item_dtype, item_nbytes
from .manifest import CheckpointError
from .restore import Checkpoint, load_state

PREFIX = "model."


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """The model's tensors a checkpoint's `.metadata` declares, by name (without `model.`)."""
    return {key[len(PREFIX):]: md for key, md in metadata.state_dict_metadata.items()
            if key.startswith(PREFIX) and isinstance(md, TensorStorageMetadata)}


class TensorStream:
    """Reads the model tensors of one opened (verified) checkpoint, each chunk checked against its hash."""

    def __init__(self, ckpt: Checkpoint, metadata: Metadata) -> None:
        self.ckpt, self.metadata = ckpt, metadata
        self.reader = ckpt.reader()
        self.where = f"{ckpt.url}/.metadata"

    def read(self, name: str) -> torch.Tensor:
        """Model tensor `name` in its stored dtype (possibly read-only: copy it before changing it in place)."""
        fqn = PREFIX + name
        md = self.metadata.state_dict_metadata[fqn]
        if not isinstance(self.reader, ChunkReader):
            out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            load_state({fqn: out}, self.reader)
            return out
        parts = []
        for chunk in md.chunks:
            info = (self.metadata.storage_data or {}).get(MetadataIndex(fqn, chunk.offsets))
            if not isinstance(info, dict) or info.get("kind") != "tensor" or list(info["shape"]) != list(chunk.sizes) \
                    or item_dtype(info["dtype"]) != md.properties.dtype:
                raise CheckpointError(f"'{self.where}' does not describe the chunk of '{fqn}' at {list(chunk.offsets)} "
                                      "as a tensor of its shape and dtype.")
            parts.append((chunk, info))
        whole = len(parts) == 1 and list(parts[0][0].sizes) == list(md.size)
        out = None if whole else torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk, info in parts:
            blob = self.reader.fetch(info["chunk"])  # its hash checked
            if memoryview(blob).nbytes != item_nbytes(info):
                raise CheckpointError(f"'{self.where}' says chunk {info['chunk'][:12]} holds {item_nbytes(info)} bytes, "
                                      f"but it holds {memoryview(blob).nbytes}.")
            t = blob_tensor(blob, info["dtype"], info["shape"])
            if out is None:
                return t
            out[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))].copy_(t)
        if out is None or sum(c.sizes.numel() for c, _ in parts) != out.numel():
            raise CheckpointError(f"'{self.where}' stores '{fqn}' in chunks that do not cover it.")
        return out
