"""Corpus -> fixed-length token shards (parquet) with a manifest of sizes and checksums.

A shard row is one training sample: seq_len+1 token ids (inputs plus the shifted target)
stored as little-endian bytes in a binary column. The manifest is written last, so a folder
without one is an unfinished preparation and is never read.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cs3ray.models import ByteTokenizer, Tokenizer, TokenizerError, check_same, tokenizer_from_json
from cs3ray.names import check_name
from cs3ray.storage import Storage, StorageError, open_url

from .corpus import Corpus, DataError, open_corpus
from .split import Split

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKEN_COLUMN = "tokens"


class ForgedManifest(DataError):
    """A shard manifest names a path where a file name belongs: refused, never prepared over."""


@dataclass(frozen=True)
class ShardSpec:
    """Everything that decides the shard contents (and so the cache key)."""

    seq_len: int
    samples_per_shard: int
    val_fraction: float
    max_bytes: int
    seed: int

    def key(self, corpus: Corpus, tokenizer: Tokenizer | None = None) -> str:
        tok = tokenizer or ByteTokenizer()
        blob = json.dumps([corpus.fingerprint(), self.__dict__, tok.to_json(), FORMAT_VERSION],
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


BPE_BATCH = 256  # documents per encode_batch call: enough to keep the tokenizer's threads busy


def encode_documents(texts: list[str], tok: Tokenizer) -> list[np.ndarray]:
    """Token ids of each document followed by the end-of-text id, as uint16 arrays."""
    eos = np.array([tok.eos_id], dtype=np.uint16)
    if isinstance(tok, ByteTokenizer):  # the byte ids are the UTF-8 bytes: no tokenizer call needed
        return [np.concatenate((np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16), eos))
                for t in texts]
    return [np.concatenate((np.asarray(ids, dtype=np.uint16), eos)) for ids in tok.encode_batch(texts)]


def _tokenize(corpus: Corpus, max_bytes: int, progress: Callable[[int], None] | None,
              tok: Tokenizer) -> np.ndarray:
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        parts.extend(encode_documents(batch, tok))
        if progress:
            progress(sum(len(t) for t in batch))
        batch.clear()

    for text in corpus.documents(max_bytes):
        batch.append(text)
        if len(batch) >= BPE_BATCH:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def encode_shard(name: str, samples: np.ndarray) -> tuple[dict, bytes]:
    """One shard's manifest entry and parquet bytes (deterministic: same samples, same bytes)."""
    col = pa.array([row.tobytes() for row in samples], type=pa.binary())
    buf = io.BytesIO()
    pq.write_table(pa.table({TOKEN_COLUMN: col}), buf, compression="zstd")
    data = buf.getvalue()
    return {"file": name, "samples": int(len(samples)), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}, data


def write_shard(dest: Storage, name: str, samples: np.ndarray) -> dict:
    """Write one shard and return its manifest entry."""
    entry, data = encode_shard(name, samples)
    dest.write_bytes(data, name)
    return entry


def check_existing(dest: Storage, tok: Tokenizer) -> dict | None:
    """The manifest already at `dest` (None if there is none); refuses one made with another tokenizer."""
    if not dest.exists(MANIFEST):
        return None
    manifest = read_manifest(dest)  # re-preparing over a shard set made with another tokenizer would mix ids
    check_same(shard_tokenizer(manifest, dest.url), tok, f"shard set '{dest.url}'", "this preparation")
    return manifest


def shard_plan(n_tokens: int, source: str, spec: ShardSpec) -> list[tuple[str, str, np.ndarray]]:
    """(split, file name, sample ids) of every shard: a pure function of the token count and the spec."""
    ids = split_ids(n_tokens, source, spec)
    return [(split, name, ids[split][start:stop]) for split, name, start, stop in shard_layout(n_tokens, source, spec)]


def _split_sizes(n_tokens: int, source: str, spec: ShardSpec) -> tuple[int, int]:
    """(samples, validation samples) of a stream of `n_tokens`; one clear error when too short."""
    n = n_tokens // (spec.seq_len + 1)
    if n < 4:
        raise DataError(f"corpus '{source}' gives only {n} samples of {spec.seq_len + 1} tokens; "
                        f"use more text or a shorter train.seq_len.")
    return n, max(1, int(round(n * spec.val_fraction)))


def shard_layout(n_tokens: int, source: str, spec: ShardSpec) -> list[tuple[str, str, int, int]]:
    """(split, file name, start, stop) of every shard: it holds that slice of its split's sorted sample ids
    (`split_of`). Needs only the counts, so a driver plans a corpus of any size without its samples."""
    n, n_val = _split_sizes(n_tokens, source, spec)
    sps = spec.samples_per_shard
    return [(split, f"{split}-{i:05d}.parquet", start, min(count, start + sps))
            for split, count in (("val", n_val), ("train", n - n_val)) for i, start in enumerate(range(0, count, sps))]


def split_of(n_tokens: int, source: str, spec: ShardSpec) -> Split:
    """The train/val split of a stream of `n_tokens` (drawn block by block: cs3ray.data.split)."""
    n, n_val = _split_sizes(n_tokens, source, spec)
    return Split(n, n_val, spec.seed)


def split_ids(n_tokens: int, source: str, spec: ShardSpec) -> dict[str, np.ndarray]:
    """The sorted sample ids of each split (all of them: for a stream held in memory)."""
    split = split_of(n_tokens, source, spec)
    return {name: split.ids(name) for name in ("val", "train")}


def build_manifest(corpus: Corpus, spec: ShardSpec, tok: Tokenizer, n_tokens: int,
                   plan: list[tuple[str, str, np.ndarray]], entries: list[dict]) -> dict:
    """The manifest of a shard set, from its plan and the written shards' entries (in plan order)."""
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "source": corpus.spec, "tokenizer": json.loads(tok.to_json()),
        "seq_len": spec.seq_len, "dtype": "uint16", "splits": {"val": [], "train": []},
    }
    for (split, _, _), entry in zip(plan, entries, strict=True):
        manifest["splits"][split].append(entry)
    manifest["samples"] = {k: sum(e["samples"] for e in v) for k, v in manifest["splits"].items()}
    manifest["tokens"] = int(n_tokens // (spec.seq_len + 1) * (spec.seq_len + 1))
    # What made it: a re-run with the same corpus, spec and tokenizer finds its work done.
    manifest["key"] = spec.key(corpus, tok)
    return manifest


def prepare_shards(corpus: Corpus, dest: Storage, spec: ShardSpec,
                   progress: Callable[[int], None] | None = None, tokenizer: Tokenizer | None = None) -> dict:
    """Tokenize `corpus` into train/val shards under `dest`; returns the manifest."""
    tok = tokenizer or ByteTokenizer()
    check_existing(dest, tok)
    tokens = _tokenize(corpus, spec.max_bytes, progress, tok)
    plan = shard_plan(len(tokens), corpus.spec, spec)
    samples = tokens[: len(tokens) // (spec.seq_len + 1) * (spec.seq_len + 1)].reshape(-1, spec.seq_len + 1)
    entries = [write_shard(dest, name, samples[idx]) for _, name, idx in plan]
    manifest = build_manifest(corpus, spec, tok, len(tokens), plan, entries)
    dest.write_text(json.dumps(manifest, indent=1), MANIFEST)
    return manifest


def read_manifest(dest: Storage) -> dict:
    """Load and sanity-check a shard manifest; one clear error when missing or malformed."""
    if not dest.exists(MANIFEST):
        raise DataError(f"'{dest.url}' has no {MANIFEST}: it is not a prepared shard set "
                        f"(run `cs3 data prepare SRC {dest.url}`).")
    return parse_manifest(dest.read_bytes(MANIFEST), dest.url)


def parse_manifest(raw: bytes, url: str) -> dict:
    """The manifest of the shard set at `url` from its stored bytes: JSON only (nothing stored is executed or
    unpickled), of this format version, with a train and a val split whose entries are checked names and counts."""
    try:
        manifest = json.loads(raw)
        assert manifest["format_version"] == FORMAT_VERSION
        assert manifest["splits"]["train"] and manifest["splits"]["val"]
        entries = [e for split in manifest["splits"].values() for e in split]
    except (ValueError, KeyError, AssertionError, TypeError, AttributeError):
        raise DataError(f"'{url}/{MANIFEST}' is corrupt or of another format version.") from None
    for entry in entries:
        _check_entry(entry, f"'{url}/{MANIFEST}'")
    return manifest


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(entry: object, source: str) -> None:
    """One shard of a manifest: a file name in the set's folder (never a path), counts and a sha256."""
    if not isinstance(entry, dict):
        raise DataError(f"{source} is corrupt (a shard entry is a {type(entry).__name__}).")
    name = check_name(entry.get("file"), source, ForgedManifest)
    if not _count(entry.get("samples")) or not _count(entry.get("bytes")) or not isinstance(entry.get("sha256"), str):
        raise DataError(f"{source} is corrupt (shard '{name}' lacks its sample count, byte size or sha256).")


def check_rows(data: bytes, entry: dict, url: str) -> None:
    """Refuse shard bytes (already checksum-verified) that hold another number of samples than the manifest
    claims: the claim sizes the sample order, so it must be what is stored (read from the parquet footer)."""
    try:
        rows = pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
    except (pa.ArrowException, OSError, ValueError):
        raise DataError(f"shard '{url}' is not a parquet file.") from None
    if rows != entry["samples"]:
        raise DataError(f"shard '{url}' holds {rows} samples, but the manifest claims {entry['samples']}.")


def shard_tokenizer(manifest: dict, url: str) -> Tokenizer:
    """The tokenizer a shard set was made with, from its manifest."""
    try:
        return tokenizer_from_json(json.dumps(manifest.get("tokenizer")), f"the tokenizer in '{url}/{MANIFEST}'")
    except TokenizerError as exc:
        raise DataError(str(exc)) from None


def verify_shard(data: bytes, entry: dict, url: str) -> None:
    """Refuse shard bytes whose checksum does not match the manifest."""
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise DataError(f"shard '{url}' does not match its checksum in the manifest (corrupt or truncated).")


def decode_tokens(column: Any) -> np.ndarray:
    """A batch of binary rows -> (batch, seq_len+1) int64 array of token ids."""
    rows = [np.frombuffer(b, dtype="<u2") for b in column]
    return np.stack(rows).astype(np.int64)


def read_split(dest: Storage, manifest: dict, split: str) -> np.ndarray:
    """All samples of a split as one array, checksums verified (used for the small val split)."""
    out = []
    for e in manifest["splits"][split]:
        data = dest.read_bytes(e["file"])
        verify_shard(data, e, dest.path(e["file"]))
        check_rows(data, e, dest.path(e["file"]))
        out.append(decode_tokens(pq.read_table(io.BytesIO(data)).column(TOKEN_COLUMN).to_pylist()))
    return np.concatenate(out)


def ensure_shards(source: str, cache_dir: str, spec: ShardSpec, fmt: str = "auto", text_column: str = "text",
                  options: dict | None = None, progress: Callable[[int], None] | None = None,
                  tokenizer: Tokenizer | None = None, distributed: bool = False) -> tuple[Storage, dict]:
    """Prepared shards for `source`, reused from the cache when its key matches, else made now
    (distributed: by the Ray Data pipeline on the connected cluster, the same output)."""
    tok = tokenizer or ByteTokenizer()
    corpus = open_corpus(source, fmt, text_column, options)
    dest = open_url(cache_dir, options).child(spec.key(corpus, tok))
    try:
        manifest = read_manifest(dest)
    except ForgedManifest:
        raise  # someone wrote it: the user looks at it, rather than cs3ray deleting it to prepare again
    except DataError:
        pass
    else:
        check_same(shard_tokenizer(manifest, dest.url), tok, f"shard set '{dest.url}'")
        return dest, manifest
    if distributed:  # an interrupted earlier preparation's shards are kept where they hold the right bytes
        from .prepare import prepare_shards_ray

        return dest, prepare_shards_ray(corpus, dest, spec, progress, tok)[0]
    try:
        if dest.exists():
            dest.rm()  # an interrupted earlier preparation: start it over
    except StorageError:
        pass
    return dest, prepare_shards(corpus, dest, spec, progress, tok)
