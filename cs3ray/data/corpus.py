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
            yield from self.jsonl_documents(f.path, raw.decode("utf-8", errors="replace").splitlines())
        else:
            table = pq.read_table(io.BytesIO(raw))
            self._check_column(f.path, table.column_names)
            yield from _values(table.column(self.text_column).to_pylist())

    def jsonl_documents(self, path: str, lines: list[str]) -> Iterator[str]:
        """The texts of JSON lines (blank lines skipped); line numbers count from the first of `lines`."""
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise LineError(path, n, "is not valid JSON.") from None
            if not isinstance(row, dict) or self.text_column not in row:
                raise LineError(path, n, f"has no '{self.text_column}' field.")
            yield str(row[self.text_column])

    def _check_column(self, path: str, columns: list[str]) -> None:
        if self.text_column not in columns:
            raise DataError(f"parquet file '{path}' has no column '{self.text_column}' "
                            f"(columns: {', '.join(columns)}).")

    def format_of(self, path: str) -> str:
        return self.fmt if self.fmt != "auto" else _format_of(path)

    def pieces(self, index: int, piece_bytes: int, split_text: bool) -> list[Piece]:
        """File `index` in parts of about `piece_bytes` (one part when it is smaller, or a text file and
        `split_text` is False: the tokenizer may not encode its parts as it encodes the whole)."""
        f = self.files[index]
        whole = self.format_of(f.path) == "text" and not split_text
        parts = 1 if whole else max(1, -(-f.size // max(1, piece_bytes)))
        return [Piece(index, f.path, f.size, k, parts) for k in range(parts)]

    def piece_bytes(self, piece: Piece) -> bytes:
        """The bytes of a text or JSONL piece: the lines that start in its share of the file, cut where
        `_find_cut` allows (any line end in JSONL; in text, see there)."""
        fs, path, size = self.storage.fs, piece.path, piece.size
        if piece.parts == 1:
            return fs.cat_file(path)
        text = self.format_of(path) == "text"
        a, b = piece.range()
        lo = max(0, a - 2)  # a cut at q looks at the bytes q-2 .. q
        body = fs.cat_file(path, start=lo, end=b)
        start = 0 if a == 0 else _find_cut(body, lo, a, size, text)
        if start is None or start >= b:
            return b""  # no cut inside the share: the part before reads its lines
        if b == size:
            return body[start - lo:]
        t0 = max(lo, b - 2)  # the line running past b ends at the first cut at or after b
        tail, step = body[t0 - lo:], 1 << 16
        while (end := _find_cut(tail, t0, b, size, text)) is None:
            more = fs.cat_file(path, start=t0 + len(tail), end=min(size, t0 + len(tail) + step))
            tail, step = tail + more, step * 2
        return body[start - lo:] + tail[b - t0:end - t0]

    def parquet_documents(self, piece: Piece) -> Iterator[str]:
        """The texts of a parquet piece's row groups, in order (None values skipped)."""
        if piece.parts == 1:
            yield from self._read(SourceFile(piece.path, piece.size))
            return
        with self.storage.fs.open(piece.path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            self._check_column(piece.path, pf.schema_arrow.names)
            groups = pf.metadata.num_row_groups  # part k holds groups g with g * parts // groups == k
            mine = [g for g in range(groups) if g * piece.parts // groups == piece.part]
            if mine:
                table = pf.read_row_groups(mine, columns=[self.text_column])
                yield from _values(table.column(self.text_column).to_pylist())


@dataclass(frozen=True)
class Piece:
    """Part `part` of `parts` of corpus file `file`: the lines starting in its share of the bytes (text,
    JSONL) or its share of the row groups (parquet). A file's parts hold its text in order, each byte once,
    so one big file spreads over many tasks without changing a document."""

    file: int
    path: str
    size: int
    part: int = 0
    parts: int = 1

    @property
    def last(self) -> bool:
        return self.part == self.parts - 1

    def range(self) -> tuple[int, int]:
        """The nominal byte share [a, b); the piece's lines are those starting at a cut in it."""
        return self.size * self.part // self.parts, self.size * (self.part + 1) // self.parts


class LineError(DataError):
    """A JSONL line that is not a document; `line` counts from the start of what was read."""

    def __init__(self, path: str, line: int, what: str) -> None:
        super().__init__(f"'{path}' line {line} {what}")
        self.path, self.line, self.what = path, line, what


def _values(values: list) -> Iterator[str]:
    return (str(v) for v in values if v is not None)


def _graphic(byte: int) -> bool:
    return 0x21 <= byte <= 0x7E


def _find_cut(buf: bytes, off: int, at: int, size: int, text: bool) -> int | None:
    """The first cut at or after file offset `at` within `buf` (the bytes from offset `off`, which is at most
    at-2 unless 0), or None when `buf` ends before one shows. A cut follows a newline; in text it also needs
    a visible ASCII character on both sides (b'x\\ny'): byte-level BPE pre-tokenizers (GPT-2's, Llama 3's
    patterns) split there and nowhere join across it, so the parts encode as the whole does. The file's end
    is always a cut."""
    pos = max(0, at - off - 1)
    while (j := buf.find(b"\n", pos)) >= 0:
        q = j + 1
        if off + q == size:
            return size
        if q >= len(buf):
            return None
        if not text or (j >= 1 and _graphic(buf[j - 1]) and _graphic(buf[q])):
            return off + q
        pos = q
    return size if off + len(buf) == size else None


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
