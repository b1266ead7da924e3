"""safetensors files read and written a block of rows at a time: a rank reads only the bytes of its slices,
and an export writes a file tensor by tensor, so neither ever holds a whole model.

The format is a little-endian u64 header length, a JSON header (name -> dtype, shape, byte range) and the
raw bytes. Reading goes through fsspec byte ranges (`cat_file(start, end)`), the same for a local path and
an object store, and maps nothing: pages a memory map touched would stay in the reader's resident memory.
Headers are data from a directory someone else wrote: every field is checked before a byte is read.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from cs3ray.models.hf_llama import HFModelError
from cs3ray.names import check_name
from cs3ray.storage import Storage, StorageError

from .chunks import blob_tensor, tensor_blob

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BLOCK_BYTES = 16 * 2**20  # bytes read (or written) at a time: small beside any tensor worth streaming
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte offset."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _entries(header: object, file: str, data_start: int, size: int) -> dict[str, Entry]:
    """The tensors a parsed header declares; anything malformed or reaching past the file is refused."""
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if dtype is None:
            raise ValueError(f"tensor '{name}' has no dtype cs3ray reads")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
                                                     for x in v)
        if not ints(shape) or not ints(offsets) or len(offsets) != 2:
            raise ValueError(f"tensor '{name}' has no valid shape and data_offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise ValueError(f"tensor '{name}' claims bytes {begin}..{end}, which do not fit its shape or the file")
        out[name] = Entry(file, dtype, tuple(shape), data_start + begin)
    return out


class SafetensorsDir:
    """The tensors of a Hugging Face directory's model.safetensors, or of the shards its index names (headers
    only: bytes are read on demand, a block of rows at a time)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.entries: dict[str, Entry] = {}
        for file in self._files():
            for name, entry in self._header(file).items():
                if name in self.entries:
                    raise HFModelError(f"'{storage.url}' holds tensor '{name}' twice ({self.entries[name].file} and "
                                       f"{file}).")
                self.entries[name] = entry

    def _files(self) -> list[str]:
        storage = self.storage
        if storage.exists(INDEX):
            try:
                names = list(json.loads(storage.read_text(INDEX))["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                raise HFModelError(f"'{storage.url}/{INDEX}' is not a valid safetensors index (no weight_map).") from None
            # Shard names are any file name Hugging Face tools chose, but never a path out of the directory.
            files = sorted({check_name(n, f"'{storage.url}/{INDEX}'", HFModelError, ours=False) for n in names})
            for name in files:
                if not storage.exists(name):
                    raise HFModelError(f"'{storage.url}' lacks the shard '{name}' that {INDEX} names.")
            return files
        if storage.exists(SINGLE):
            return [SINGLE]
        raise HFModelError(f"'{storage.url}' has neither {SINGLE} nor {INDEX}; cs3ray reads safetensors weights "
                           "only (never pickled .bin files).")

    def _range(self, file: str, start: int, end: int) -> bytes:
        storage = self.storage
        blob = storage.call(lambda: storage.fs.cat_file(storage.path(file), start=start, end=end), file,
                            action="read")
        if len(blob) != end - start:
            raise HFModelError(f"'{storage.url}/{file}' ended before byte {end} (it was changed while being read).")
        return blob

    def _header(self, file: str) -> dict[str, Entry]:
        storage = self.storage
        try:
            size = int(storage.call(lambda: storage.fs.size(storage.path(file)), file, action="check"))
            if size < 8:
                raise ValueError("it is shorter than a header")
            (n,) = struct.unpack("<Q", self._range(file, 0, 8))
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"its header claims {n} bytes")
            return _entries(json.loads(self._range(file, 8, 8 + n)), file, 8 + n, size)
        except (ValueError, UnicodeDecodeError, StorageError) as exc:
            raise HFModelError(f"'{storage.url}/{file}' is not a readable safetensors file ({str(exc)[:120]}).") \
                from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def blocks(self, name: str, start: int, stop: int, group: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of rows [start, stop) of tensor `name`, in its stored dtype, a block at a time;
        each block holds whole groups of `group` rows (start and stop are multiples of it)."""
        e = self.entries[name]
        per = max(group, BLOCK_BYTES // max(e.row_bytes, 1) // group * group)
        for lo in range(start, stop, per):
            hi = min(stop, lo + per)
            blob = self._range(e.file, e.start + lo * e.row_bytes, e.start + hi * e.row_bytes)
            yield lo, blob_tensor(blob, str(e.dtype), [hi - lo, *e.shape[1:]])

    def read_into(self, name: str, out: torch.Tensor, offset: tuple[int, ...], group: int = 1,
                  permute: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """out <- the slice of tensor `name` starting at `offset` (out's shape), converted to out's dtype and device.

        `permute` reorders rows within whole groups of `group` rows (a q/k projection's heads): blocks are read
        group-aligned, reordered, and only the slice's rows kept.
        """
        if not out.numel():
            return
        first, last = offset[0], offset[0] + out.shape[0]
        cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:], strict=True))
        start, stop = first // group * group, -(-last // group) * group
        for lo, rows in self.blocks(name, start, stop, group):
            if permute is not None:
                rows = permute(rows)
            a, b = max(lo, first), min(lo + rows.shape[0], last)
            out[a - first:b - first].copy_(rows[(slice(a - lo, b - lo), *cols)])

    def equal_rows(self, a: str, b: str, start: int, stop: int) -> bool:
        """Whether rows [start, stop) of tensors `a` and `b` hold the same values (compared block by block)."""
        if self.entries[a].shape != self.entries[b].shape:
            return False
        for (_, x), (_, y) in zip(self.blocks(a, start, stop), self.blocks(b, start, stop), strict=True):
            if not torch.equal(x, y.to(x.dtype)):
                return False
        return True


def header(items: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `items` in order (8-byte aligned)."""
    head: dict[str, object] = {"__metadata__": metadata}
    pos = 0
    for name, dtype, shape in items:
        n = math.prod(shape) * dtype.itemsize
        head[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(storage: Storage, name: str, items: list[tuple[str, torch.dtype, tuple[int, ...]]],
               blocks: Callable[[str], Iterable[torch.Tensor]], metadata: dict[str, str]) -> int:
    """Write the safetensors file `name`: its header, then each item's rows as `blocks(item)` yields them
    (in its dtype, in order); returns the bytes written. One block is held at a time."""
    total = 0
    with storage.open(name, mode="wb") as f:
        head = header(items, metadata)
        f.write(head)
        total += len(head)
        for item, dtype, shape in items:
            want = math.prod(shape) * dtype.itemsize
            done = 0
            for block in blocks(item):
                if block.dtype != dtype:
                    raise ValueError(f"a block of '{item}' is {block.dtype}, not {dtype}")
                data = tensor_blob(block)
                f.write(memoryview(data))
                done += data.nbytes
            if done != want:
                raise ValueError(f"'{item}' gave {done} bytes, not the {want} of its shape {shape}")
            total += done
    return total
