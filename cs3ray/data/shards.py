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
from cs3ray.storage import Storage, StorageError, open_url

from .corpus import Corpus, DataError, open_corpus

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKEN_COLUMN = "tokens"


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


def _tokenize(corpus: Corpus, max_bytes: int, progress: Callable[[int], None] | None,
              tok: Tokenizer) -> np.ndarray:
    parts: list[np.ndarray] = []
    eos = np.array([tok.eos_id], dtype=np.uint16)
    batch: list[str] = []

    def flush() -> None:
        for ids in tok.encode_batch(batch):
            parts.extend((np.asarray(ids, dtype=np.uint16), eos))
        if progress:
            progress(sum(len(t) for t in batch))
        batch.clear()

    for text in corpus.documents(max_bytes):
        if isinstance(tok, ByteTokenizer):  # the byte ids are the UTF-8 bytes: no tokenizer call needed
            parts.extend((np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16), eos))
            if progress:
                progress(len(text))
            continue
        batch.append(text)
        if len(batch) >= BPE_BATCH:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _write_shard(dest: Storage, name: str, samples: np.ndarray) -> dict:
    col = pa.array([row.tobytes() for row in samples], type=pa.binary())
    buf = io.BytesIO()
    pq.write_table(pa.table({TOKEN_COLUMN: col}), buf, compression="zstd")
    data = buf.getvalue()
    dest.write_bytes(data, name)
    return {"file": name, "samples": int(len(samples)), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def prepare_shards(corpus: Corpus, dest: Storage, spec: ShardSpec,
                   progress: Callable[[int], None] | None = None, tokenizer: Tokenizer | None = None) -> dict:
    """Tokenize `corpus` into train/val shards under `dest`; returns the manifest."""
    tok = tokenizer or ByteTokenizer()
    if dest.exists(MANIFEST):  # re-preparing over a shard set made with another tokenizer would mix ids
        check_same(shard_tokenizer(read_manifest(dest), dest.url), tok, f"shard set '{dest.url}'",
                   "this preparation")
    tokens = _tokenize(corpus, spec.max_bytes, progress, tok)
    n = len(tokens) // (spec.seq_len + 1)
    if n < 4:
        raise DataError(f"corpus '{corpus.spec}' gives only {n} samples of {spec.seq_len + 1} tokens; "
                        f"use more text or a shorter train.seq_len.")
    samples = tokens[: n * (spec.seq_len + 1)].reshape(n, spec.seq_len + 1)
    order = np.random.default_rng(spec.seed).permutation(n)
    n_val = max(1, int(round(n * spec.val_fraction)))
    splits = {"val": np.sort(order[:n_val]), "train": np.sort(order[n_val:])}
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "source": corpus.spec, "tokenizer": json.loads(tok.to_json()),
        "seq_len": spec.seq_len, "dtype": "uint16", "splits": {},
    }
    for split, idx in splits.items():
        entries = []
        for i, start in enumerate(range(0, len(idx), spec.samples_per_shard)):
            chunk = samples[idx[start:start + spec.samples_per_shard]]
            entries.append(_write_shard(dest, f"{split}-{i:05d}.parquet", chunk))
        manifest["splits"][split] = entries
    manifest["samples"] = {k: sum(e["samples"] for e in v) for k, v in manifest["splits"].items()}
    manifest["tokens"] = int(n * (spec.seq_len + 1))
    dest.write_text(json.dumps(manifest, indent=1), MANIFEST)
    return manifest


def read_manifest(dest: Storage) -> dict:
    """Load and sanity-check a shard manifest; one clear error when missing or malformed."""
    if not dest.exists(MANIFEST):
        raise DataError(f"'{dest.url}' has no {MANIFEST}: it is not a prepared shard set "
                        f"(run `cs3 data prepare SRC {dest.url}`).")
    try:
        manifest = json.loads(dest.read_text(MANIFEST))
        assert manifest["format_version"] == FORMAT_VERSION
        assert manifest["splits"]["train"] and manifest["splits"]["val"]
    except (ValueError, KeyError, AssertionError, TypeError):
        raise DataError(f"'{dest.url}/{MANIFEST}' is corrupt or of another format version.") from None
    return manifest


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
        out.append(decode_tokens(pq.read_table(io.BytesIO(data)).column(TOKEN_COLUMN).to_pylist()))
    return np.concatenate(out)


def ensure_shards(source: str, cache_dir: str, spec: ShardSpec, fmt: str = "auto", text_column: str = "text",
                  options: dict | None = None, progress: Callable[[int], None] | None = None,
                  tokenizer: Tokenizer | None = None) -> tuple[Storage, dict]:
    """Prepared shards for `source`, reused from the cache when its key matches, else made now."""
    tok = tokenizer or ByteTokenizer()
    corpus = open_corpus(source, fmt, text_column, options)
    dest = open_url(cache_dir, options).child(spec.key(corpus, tok))
    try:
        manifest = read_manifest(dest)
    except DataError:
        pass
    else:
        check_same(shard_tokenizer(manifest, dest.url), tok, f"shard set '{dest.url}'")
        return dest, manifest
    try:
        if dest.exists():
            dest.rm()  # an interrupted earlier preparation: start it over
    except StorageError:
        pass
    return dest, prepare_shards(corpus, dest, spec, progress, tok)
