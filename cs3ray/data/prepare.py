"""Shard preparation on the cluster, byte-identical to `prepare_shards`, with nothing of the corpus on the driver.

Three stages, each spread over the cluster:
1. tokenize: Ray Data tasks read pieces of the corpus (whole small files; big text and JSONL files cut
   at line ends into byte ranges, parquet files into shares of their row groups), tokenize them and
   write their tokens as one run file per task to the destination's staging area (each document's
   characters and tokens in an index file beside it). They report only counts: a piece's characters,
   tokens and documents, and where it failed.
2. plan: from the counts the driver lays out the token stream (which byte ranges of which runs, in
   corpus order, cut after the document that reaches `max_bytes` as `Corpus.documents` does) and the
   shards (names and sample counts: `shard_layout`).
3. write: plain Ray tasks build each shard from its slice of its split's sorted sample ids, drawn in
   the task from the few blocks of the split it touches (cs3ray.data.split: no process holds every
   sample's id), and the byte ranges of the runs those samples lie in, and write it (skipping a shard
   already there with the same bytes).
The manifest is written last, after the staging area is removed.

Why the output does not depend on the cluster. A piece's tokens are those of its documents whatever
task reads it, the stream is their concatenation in corpus order, and the shards are a pure function of
the stream and the spec, so pieces, tasks and nodes change only where the work runs, never what is
written. A text file is one document: it is cut only where the tokenizer encodes the parts as it encodes
the whole (`corpus._find_cut`, checked for each tokenizer by `_splits_text`).

What the driver holds: one row of totals per piece as it walks them (a piece's per-document counts are read
from the staging area only where the cut falls), and the stream's layout (a few integers per run). Its
memory stays flat as the corpus grows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa

from cs3ray.models import ByteTokenizer, Tokenizer, tokenizer_from_json
from cs3ray.storage import Storage, StorageError

from .corpus import Corpus, DataError, LineError, Piece
from .peak_rss import PeakRss
from .ray_settings import ray_data_settings
from .shards import (
    BPE_BATCH,
    MANIFEST,
    ShardSpec,
    build_manifest,
    check_existing,
    encode_documents,
    encode_shard,
    shard_layout,
    split_of,
)
from .split import Split

BLOCKS_PER_TASK = 4  # blocks per concurrent task: small blocks keep every CPU busy to the end
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 20, 64 << 20  # a file is cut into pieces of this size (automatic)
GROUP_BYTES = 128 << 20  # at most about this much source text per tokenize task (its tokens stay in memory)
READ_GAP = 1 << 16  # a shard writer reads through gaps up to this many bytes between samples, in one request
STAGING = ".cs3-staging"  # below the destination; removed before the manifest is written


class Prepared(NamedTuple):
    """What `prepare_shards_ray` returns."""

    manifest: dict
    kept: int  # shards already there with the right bytes, left alone
    driver_peak_rss_mb: float  # the driver process' peak resident memory during the preparation


@functools.lru_cache(maxsize=2)
def _tokenizer(text: str) -> Tokenizer:
    # Ray reuses worker processes across tasks, so each builds a BPE tokenizer once, not per block.
    return tokenizer_from_json(text, "the preparation's tokenizer")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Hugging Face tokenizers without its thread pool (of every core) inside: a task holds one CPU."""
    # The library reads this on every call, while the pool's size is fixed once a process has used it:
    # so it holds in a reused worker too, and the worker gets its setting back for whatever runs next.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


# Text cut where `corpus._find_cut` cuts it (after b"x\n" before b"y"), as seen by the tokenizer.
_PROBES = [("def f(x):\n", "return x\n"), ("One. Two!\n", "Three?"), ("x = [1, 22];\n", "y = 333"),
           ("a'\n", "'s b"), ("élan 数据.\n", "b  c\n\n"), ("12\n", "34"), ("<tag>\n", "</tag>")]


def _splits_text(tok: Tokenizer) -> bool:
    """Whether text cut at `_find_cut`'s cuts encodes, part by part, as the whole does. Bytes always do;
    a byte-level BPE does when its pre-tokenizer splits at such a cut and nothing is added per call
    (GPT-2's and Llama 3's patterns, `cs3 data tokenizer`'s): probed, so any other keeps text files whole."""
    if isinstance(tok, ByteTokenizer):
        return True
    with _one_thread():
        whole = tok.encode_batch([a + b for a, b in _PROBES])
        parts = tok.encode_batch([t for pair in _PROBES for t in pair])
    return all(w == parts[2 * i] + parts[2 * i + 1] for i, w in enumerate(whole))


def _piece_tokens(corpus: Corpus, piece: Piece, tok: Tokenizer) -> tuple[list[np.ndarray], np.ndarray, dict[str, Any]]:
    """Tokens of one piece (a list of arrays), each fragment's (characters, tokens), and its row of counts.

    Text: one fragment of its file's single document (the end-of-text id after the last piece; `open`
    until then; `bad` when the bytes are not UTF-8, which skips the whole file). JSONL and parquet: one
    fragment per non-empty document. `error` (with `error_line` for a JSONL line, counted from the piece's
    first line, of `lines`) is raised by the driver only if the stream needs what follows it."""
    fmt = corpus.format_of(piece.path)
    row: dict[str, Any] = {"file": piece.file, "text": fmt == "text", "open": fmt == "text" and not piece.last,
                           "bad": False, "lines": 0, "error": "", "error_line": 0}
    texts: list[str] = []
    try:
        if fmt == "text":
            try:
                texts.append(corpus.piece_bytes(piece).decode("utf-8"))
            except UnicodeDecodeError:
                texts.append("")
                row["bad"] = True
        elif fmt == "jsonl":
            lines = corpus.piece_bytes(piece).decode("utf-8", errors="replace").splitlines()
            row["lines"] = len(lines)
            texts.extend(t for t in corpus.jsonl_documents(piece.path, lines) if t)
        else:
            texts.extend(t for t in corpus.parquet_documents(piece) if t)
    except LineError as exc:  # the documents before it count; the driver numbers the line in its file
        row["error"], row["error_line"] = exc.what, exc.line
    except DataError as exc:
        row["error"] = str(exc)
    except (OSError, pa.ArrowException) as exc:
        row["error"] = f"cannot read corpus file '{piece.path}': {exc}"
    if fmt == "text" and row["error"]:
        texts = []  # the document is incomplete: nothing of it is used
    with _one_thread():
        docs = [d for s in range(0, len(texts), BPE_BATCH) for d in encode_documents(texts[s:s + BPE_BATCH], tok)]
    if row["open"] and docs:
        docs[0] = docs[0][:-1]  # the document goes on in the next piece
    counts = np.array([(len(t), len(d)) for t, d in zip(texts, docs, strict=True)], dtype=np.int64).reshape(-1, 2)
    row.update(docs=len(docs), chars=int(counts[:, 0].sum()), tokens=int(counts[:, 1].sum()))
    return docs, counts, row


def _tokenize_group(batch: pa.Table, corpus: Corpus, tok_json: str, staging: Storage) -> pa.Table:
    """Ray Data task: each group's pieces -> their tokens in one run file in the staging area, their documents'
    (characters, tokens) in an index file beside it, and one row of totals per piece (where in the run its
    tokens start, where in the index its documents'): the driver reads a piece's index only if it cuts there."""
    tok = _tokenizer(tok_json)
    rows: list[dict[str, Any]] = []
    for pieces, run in zip(batch.column("pieces").to_pylist(), batch.column("run").to_pylist(), strict=True):
        tokens: list[np.ndarray] = []
        index: list[np.ndarray] = []
        group: list[dict[str, Any]] = []
        offset = at = 0
        for p in pieces:
            docs, counts, row = _piece_tokens(corpus, Piece(**p), tok)
            row.update(run=f"{run}.u16", offset=offset, index=f"{run}.idx", index_at=at)
            offset, at = offset + row["tokens"], at + len(counts)
            tokens.extend(docs)
            index.append(counts)
            group.append(row)
        try:
            staging.write_bytes(np.concatenate(tokens) if tokens else b"", f"{run}.u16", durable=False)
            staging.write_bytes(np.concatenate(index).astype("<i8"), f"{run}.idx", durable=False)
        except StorageError as exc:  # nothing of this group can be used: the driver fails on reaching it
            group = [{**group[0], "docs": 0, "open": False, "error": str(exc), "error_line": 0}]
        rows.extend(group)
    return pa.Table.from_pylist(rows, schema=_COUNTS)


_COUNTS = pa.schema([("file", pa.int64()), ("text", pa.bool_()), ("open", pa.bool_()), ("bad", pa.bool_()),
                     ("lines", pa.int64()), ("error", pa.string()), ("error_line", pa.int64()),
                     ("docs", pa.int64()), ("chars", pa.int64()), ("tokens", pa.int64()), ("run", pa.string()),
                     ("offset", pa.int64()), ("index", pa.string()), ("index_at", pa.int64())])


@dataclasses.dataclass
class _Stream:
    """The token stream as byte ranges of runs, built from the pieces' counts in corpus order."""

    corpus: Corpus
    staging: Storage
    max_bytes: int
    progress: Callable[[int], None] | None
    runs: list[str] = dataclasses.field(default_factory=list)  # one per segment: (run, start, length) tokens
    starts: list[int] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    produced: int = 0  # characters of the documents taken
    pending: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # a text file's parts so far
    pending_chars: int = 0
    pending_bad: bool = False
    file: int = -1
    line_base: int = 0  # JSONL lines of the current file in the pieces before

    @property
    def done(self) -> bool:
        return self.produced >= self.max_bytes

    def _add(self, run: str, start: int, length: int) -> None:
        if length <= 0:
            return
        if self.runs and self.runs[-1] == run and self.starts[-1] + self.lengths[-1] == start:
            self.lengths[-1] += length
        else:
            self.runs.append(run)
            self.starts.append(start)
            self.lengths.append(length)

    def _took(self, chars: int) -> None:
        self.produced += chars
        if self.progress:
            self.progress(chars)

    def take(self, row: dict[str, Any]) -> None:
        """Add one piece's documents (up to the one that reaches max_bytes); raise its error if reached."""
        if row["file"] != self.file:
            self.file, self.line_base = row["file"], 0
        if row["text"]:
            self.pending_bad |= row["bad"]
            if row["docs"]:
                self.pending.append((row["run"], row["offset"], row["tokens"]))
                self.pending_chars += row["chars"]
                if not row["open"]:  # the file's document is complete: empty or not UTF-8 files are skipped
                    if not self.pending_bad and self.pending_chars > 0:
                        for part in self.pending:
                            self._add(*part)
                        self._took(self.pending_chars)
                    self.pending, self.pending_chars, self.pending_bad = [], 0, False
        elif row["docs"] and self.produced + row["chars"] < self.max_bytes:
            self._add(row["run"], row["offset"], row["tokens"])
            self._took(row["chars"])
        elif row["docs"]:  # the cut is in this piece: after the document that reaches max_bytes
            at = 16 * row["index_at"]
            counts = np.frombuffer(_read_range(self.staging, row["index"], at, at + 16 * row["docs"]), "<i8")
            chars, lengths = counts[0::2], counts[1::2]
            docs = int(np.searchsorted(self.produced + np.cumsum(chars), self.max_bytes)) + 1
            self._add(row["run"], row["offset"], int(lengths[:docs].sum()))
            self._took(int(chars[:docs].sum()))
        if self.done:
            return
        if row["error"]:
            if row["error_line"]:
                path = self.corpus.files[row["file"]].path
                raise DataError(f"'{path}' line {self.line_base + row['error_line']} {row['error']}")
            raise DataError(row["error"])
        self.line_base += row["lines"]

    def layout(self) -> "_Layout":
        names = sorted(set(self.runs))
        index = {n: i for i, n in enumerate(names)}
        lengths = np.array(self.lengths, dtype=np.int64)
        return _Layout(names, np.array([index[r] for r in self.runs], dtype=np.int64),
                       np.array(self.starts, dtype=np.int64), np.concatenate(([0], np.cumsum(lengths))))


@dataclasses.dataclass
class _Layout:
    """Segment i of the stream: tokens starts[i].. of run names[run[i]], at stream offsets at[i]..at[i+1]."""

    names: list[str]
    run: np.ndarray
    starts: np.ndarray
    at: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.at[-1])

    def ranges(self, lo: int, hi: int) -> list[tuple[str, int, int]]:
        """(run, first token, end token) of the runs holding stream tokens [lo, hi), in order."""
        out = []
        i = int(np.searchsorted(self.at, lo, side="right")) - 1
        while lo < hi:
            end = min(hi, int(self.at[i + 1]))
            first = int(self.starts[i]) + lo - int(self.at[i])
            out.append((self.names[int(self.run[i])], first, first + end - lo))
            lo, i = end, i + 1
        return out


def _groups(pieces: list[Piece], count: int, wave: int) -> list[dict[str, Any]]:
    """Consecutive pieces in `count` groups of about equal bytes (tasks of equal work, in order), each
    with the name of the run its tokens go to."""
    sizes = np.array([p.size / p.parts for p in pieces], dtype=np.float64)
    bounds = np.searchsorted(np.cumsum(sizes), np.arange(1, count) * sizes.sum() / count, side="left") + 1
    cuts = [0, *sorted({int(b) for b in bounds if 0 < b < len(pieces)}), len(pieces)]
    return [{"pieces": [dataclasses.asdict(p) for p in pieces[a:b]], "run": f"runs/{wave:05d}-{g:06d}"}
            for g, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]


def _is_local(storage: Storage) -> bool:
    protocol = storage.fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def _placement(local: bool, parallelism: int) -> dict[str, Any]:
    """map_batches arguments: at most `parallelism` tasks at once; a local path exists on the driver's
    machine only, so its tasks run there, while URLs are read and written from every node."""
    import ray

    args: dict[str, Any] = {"compute": ray.data.TaskPoolStrategy(size=parallelism)}
    if local:
        args["label_selector"] = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    return args


def _task_options(local: bool) -> dict[str, Any]:
    """Plain tasks' placement: on the driver's node for a local destination, spread for a URL."""
    import ray

    if local:
        return {"num_cpus": 1, "label_selector": {"ray.io/node-id": ray.get_runtime_context().get_node_id()}}
    return {"num_cpus": 1, "scheduling_strategy": "SPREAD"}


def _tokenize(corpus: Corpus, tok: Tokenizer, staging: Storage, max_bytes: int,
              progress: Callable[[int], None] | None, parallelism: int, piece_bytes: int | None) -> _Layout:
    """Tokenize the corpus into runs in `staging`; the stream's layout, up to the document that reaches
    `max_bytes` of text.

    Only the files that can still be needed are tokenized: a wave takes the next files up to a tenth more
    bytes than the text still missing (a character is at least one byte of a text file), and another
    wave follows only if their documents fell short.
    """
    import ray

    args = {"corpus": dataclasses.replace(corpus, files=[]), "tok_json": tok.to_json(), "staging": staging}
    local = _is_local(corpus.storage) or _is_local(staging)
    split_text = _splits_text(tok)
    sizes = np.array([f.size for f in corpus.files], dtype=np.int64)
    stream = _Stream(corpus, staging, max_bytes, progress)
    first, wave = 0, 0
    while first < len(corpus.files) and not stream.done:
        want = (max_bytes - stream.produced) * 1.1
        stop = min(len(corpus.files), first + 1 + int(np.searchsorted(np.cumsum(sizes[first:]), want)))
        wave_bytes = int(sizes[first:stop].sum())
        tasks = BLOCKS_PER_TASK * parallelism
        size = piece_bytes or int(np.clip(wave_bytes // tasks, MIN_PIECE_BYTES, MAX_PIECE_BYTES))
        pieces = [p for i in range(first, stop) for p in corpus.pieces(i, size, split_text)]
        groups = _groups(pieces, max(tasks, -(-wave_bytes // GROUP_BYTES)), wave)
        ds = ray.data.from_items(groups, override_num_blocks=len(groups))
        ds = ds.map_batches(_tokenize_group, batch_size=None, batch_format="pyarrow", fn_kwargs=args,
                            num_cpus=1, **_placement(local, min(parallelism, len(groups))))  # one CPU: the one thread its tokenizer uses (`_one_thread`)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                stream.take(row)
                if stream.done:
                    break
            if stream.done:
                break
        first, wave = stop, wave + 1
    return stream.layout()


def _samples(ids: np.ndarray, width: int, staging: Storage, layout: _Layout) -> np.ndarray:
    """The samples `ids` (sorted) of the stream, read as byte ranges of the runs: samples closer than
    READ_GAP are read in one request, all requests at once (concurrent on object stores)."""
    if not len(ids):
        return np.zeros((0, width), dtype=np.uint16)
    starts = ids * width
    breaks = np.nonzero(starts[1:] - starts[:-1] - width > READ_GAP // 2)[0] + 1
    spans = list(itertools.pairwise([0, *breaks, len(ids)]))  # samples a..b-1 are read in one request
    parts = [(i, r) for i, (a, b) in enumerate(spans) for r in layout.ranges(int(starts[a]), int(starts[b - 1]) + width)]
    paths = [staging.path(run) for _, (run, _, _) in parts]
    blobs = staging.call(lambda: staging.fs.cat_ranges(paths, [2 * a for _, (_, a, _) in parts],
                                                       [2 * b for _, (_, _, b) in parts], on_error="raise"),
                         action="read")
    joined: list[list[bytes]] = [[] for _ in spans]
    for (i, _), blob in zip(parts, blobs, strict=True):
        joined[i].append(blob)
    rows = []
    for (a, b), blobs_i in zip(spans, joined, strict=True):
        tokens = np.frombuffer(b"".join(blobs_i), dtype=np.uint16)
        rows.append(tokens[(starts[a:b] - starts[a])[:, None] + np.arange(width)])
    return np.concatenate(rows)


def _read_range(storage: Storage, name: str, start: int, end: int) -> bytes:
    return storage.call(lambda: storage.fs.cat_file(storage.path(name), start=start, end=end), name, action="read")


def _write_shards(shards: list[tuple[int, str, str, int, int]], dest: Storage, staging: Storage,
                  layout: _Layout, width: int, split_plan: Split) -> list[dict]:
    """Ray task: build and write these shards (skipping files that already hold the same bytes)."""
    out = []
    for j, split, name, start, stop in shards:
        same, error, entry = False, "", {}
        try:
            ids = split_plan.ids(split, start, stop)
            entry, data = encode_shard(name, _samples(ids, width, staging, layout))
            same = dest.exists(name) and hashlib.sha256(dest.read_bytes(name)).hexdigest() == entry["sha256"]
            if not same:
                dest.write_bytes(data, name)
        except StorageError as exc:  # one sentence on the driver, not a task traceback
            error = str(exc)
        out.append({"shard": j, "entry": entry, "skipped": same, "error": error})
    return out


def _write_all(layout: list[tuple[str, str, int, int]], dest: Storage, staging: Storage, stream: _Layout,
               width: int, split_plan: Split, workers: int, on_shards: Callable[[int, int], None] | None,
               ) -> list[dict]:
    """Every shard of `layout`, written by plain Ray tasks; results in shard order."""
    import ray

    shards = [(j, split, name, a, b) for j, (split, name, a, b) in enumerate(layout)]
    # One task per CPU the tokenize stage used: its worker processes are warm, while every task beyond
    # them would start (and import cs3ray into) a new process, which costs more than a shard's writing.
    chunks = [shards[i::workers] for i in range(min(len(shards), workers))]
    task = ray.remote(_write_shards).options(**_task_options(_is_local(dest)))
    stream_ref = ray.put(stream)
    pending = [task.remote(c, dest, staging, stream_ref, width, split_plan) for c in chunks]
    rows: list[dict] = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rows.extend(ray.get(done[0]))
        if on_shards:
            on_shards(len(rows), len(shards))
    return sorted(rows, key=lambda r: r["shard"])


def _verified(dest: Storage, manifest: dict) -> bool:
    try:
        return all(dest.exists(e["file"]) and hashlib.sha256(dest.read_bytes(e["file"])).hexdigest() == e["sha256"]
                   for entries in manifest["splits"].values() for e in entries)
    except StorageError:
        return False


def prepare_shards_ray(corpus: Corpus, dest: Storage, spec: ShardSpec, progress: Callable[[int], None] | None = None,
                       tokenizer: Tokenizer | None = None, parallelism: int | None = None,
                       progress_bars: bool = False, on_shards: Callable[[int, int], None] | None = None,
                       piece_bytes: int | None = None) -> Prepared:
    """`prepare_shards` on the connected Ray cluster; returns the manifest, the shards already there and
    left alone, and the driver's peak RSS.

    parallelism: concurrent tasks per stage (default: the cluster's CPUs); piece_bytes: files larger than
    this are read in parts of about this size (default: from the corpus and the parallelism). Neither
    changes the output. progress: characters of text taken so far; on_shards: (shards written, of total).
    """
    with PeakRss() as peak:
        manifest, kept = _prepare(corpus, dest, spec, progress, tokenizer or ByteTokenizer(), parallelism,
                                  progress_bars, on_shards, piece_bytes)
    return Prepared(manifest, kept, peak.mb)


def _prepare(corpus: Corpus, dest: Storage, spec: ShardSpec, progress: Callable[[int], None] | None,
             tok: Tokenizer, parallelism: int | None, progress_bars: bool,
             on_shards: Callable[[int, int], None] | None, piece_bytes: int | None) -> tuple[dict, int]:
    import ray

    existing = check_existing(dest, tok)
    if existing and existing.get("key") == spec.key(corpus, tok) and _verified(dest, existing):
        return existing, sum(len(v) for v in existing["splits"].values())
    workers = max(1, parallelism or int(ray.cluster_resources().get("CPU", 1)))
    staging = dest.child(STAGING)
    staging.rm(missing_ok=True)  # an interrupted earlier preparation's runs: made again
    try:
        with ray_data_settings(preserve_order=True, progress_bars=progress_bars):
            stream = _tokenize(corpus, tok, staging, spec.max_bytes, progress, workers, piece_bytes)
        layout = shard_layout(stream.tokens, corpus.spec, spec)
        rows = _write_all(layout, dest, staging, stream, spec.seq_len + 1, split_of(stream.tokens, corpus.spec, spec),
                          workers, on_shards)
        failed = next((r["error"] for r in rows if r["error"]), None)
        if failed:
            raise StorageError(failed)
        staging.rm(missing_ok=True)
    except BaseException:
        with contextlib.suppress(StorageError):
            staging.rm(missing_ok=True)
        raise
    plan = [(split, name, None) for split, name, _, _ in layout]
    manifest = build_manifest(corpus, spec, tok, stream.tokens, plan, [r["entry"] for r in rows])
    dest.write_text(json.dumps(manifest, indent=1), MANIFEST)
    return manifest, sum(1 for r in rows if r["skipped"])
