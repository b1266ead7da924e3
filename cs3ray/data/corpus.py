"""Corpus sources: documents as text, from the Python installation, a local dir or any fsspec URL."""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import sysconfig
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow.parquet as pq

from cs3ray.errors import UserError
from cs3ray.storage import Storage, StorageError, open_url

STDLIB = "python-stdlib"
TEXT_EXTENSIONS = (".py", ".txt", ".md", ".rst", ".json", ".cfg", ".toml", ".yaml", ".yml", ".html", ".c", ".h")


class DataError(UserError):
    """The corpus or a shard set cannot be used; the message names the path."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int


@dataclass
class Corpus:
    """A list of files read in a fixed order, so the same source always gives the same tokens."""

    spec: str
    storage: Storage
    files: list[SourceFile]
    fmt: str
    text_column: str

    def fingerprint(self) -> str:
        """Hash of what the corpus contains (names and sizes), for the shard cache key."""
        h = hashlib.sha256(json.dumps([self.spec, self.fmt, self.text_column]).encode())
        for f in self.files:
            h.update(f"{f.path}\0{f.size}\n".encode())
        return h.hexdigest()

    def documents(self, max_bytes: int) -> Iterator[str]:
        """Yield document texts until about `max_bytes` of text has been produced."""
        produced = 0
        for f in self.files:
            if produced >= max_bytes:
                return
            for text in self._read(f):
                if not text:
                    continue
                produced += len(text)
                yield text
                if produced >= max_bytes:
                    return

    def file_documents(self, f: SourceFile) -> Iterator[str]:
        """The non-empty document texts of one file, as `documents` yields them."""
        return (text for text in self._read(f) if text)

    def _read(self, f: SourceFile) -> Iterator[str]:
        fmt = self.fmt if self.fmt != "auto" else _format_of(f.path)
        try:
            raw = self.storage.fs.cat_file(f.path)
        except (OSError, StorageError) as exc:
            raise DataError(f"cannot read corpus file '{f.path}': {exc}") from None
        if fmt == "text":
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                return  # binary files in a text folder are skipped, not fatal
        elif fmt == "jsonl":
            for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"'{f.path}' line {n} is not valid JSON.") from None
                if not isinstance(row, dict) or self.text_column not in row:
                    raise DataError(f"'{f.path}' line {n} has no '{self.text_column}' field.")
                yield str(row[self.text_column])
        else:
            table = pq.read_table(io.BytesIO(raw))
            if self.text_column not in table.column_names:
                raise DataError(f"parquet file '{f.path}' has no column '{self.text_column}' "
                                f"(columns: {', '.join(table.column_names)}).")
            for value in table.column(self.text_column).to_pylist():
                if value is not None:
                    yield str(value)


def _format_of(path: str) -> str:
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    return "text"


def _stdlib_files() -> list[SourceFile]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        # Installed packages differ between machines; the standard library does not.
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                p = os.path.join(d, name)
                out.append(SourceFile(p, os.path.getsize(p)))
    return out


def open_corpus(spec: str, fmt: str = "auto", text_column: str = "text",
                options: dict[str, Any] | None = None) -> Corpus:
    """Resolve a corpus spec to an ordered file list; one clear error when it is empty or missing."""
    if spec == STDLIB:
        return Corpus(spec, open_url("/"), _stdlib_files(), "text", text_column)
    storage = open_url(spec, options)
    fs, root = storage.fs, storage.root
    try:
        if not fs.exists(root):
            raise DataError(f"corpus '{spec}' does not exist.")
        if fs.isdir(root):
            found = fs.find(root, detail=True)
            wanted = (".parquet", ".jsonl", ".ndjson") if fmt in ("parquet", "jsonl") else None
            files = [SourceFile(p, int(info.get("size") or 0)) for p, info in sorted(found.items())
                     if not posixpath.basename(p).startswith(".")
                     and (p.endswith(wanted) if wanted else (fmt != "auto" or p.endswith(TEXT_EXTENSIONS + (".parquet", ".jsonl", ".ndjson"))))]
        else:
            files = [SourceFile(root, int(fs.size(root) or 0))]
    except DataError:
        raise
    except OSError as exc:
        raise DataError(f"cannot list corpus '{spec}': {exc}") from None
    if not files:
        raise DataError(f"corpus '{spec}' contains no readable text, parquet or jsonl files.")
    return Corpus(spec, storage, files, fmt, text_column)
