"""A prepared shard set named as `data.source`: found, checked against the job and verified before training.

`cs3 data prepare SRC DEST` then `data.source: DEST` trains on DEST as it is: nothing is tokenized or
prepared again. What is verified where, so that a set of 100k shards on object storage costs the driver
one manifest read and one listing, never every shard's bytes:

- the driver, before any worker starts (here): the manifest is JSON (nothing stored is unpickled or
  executed), of this format version, names only file names, and its counts add up; its tokenizer and
  seq_len are the job's; and the folder's listing holds every shard it names, at the byte size it lists;
- each rank, as it reads a shard and before it uses any of its samples (`cs3ray.data.cache.tiered`,
  `shards.read_split`): the bytes' sha256 and the parquet footer's row count against the manifest entry.
"""

from __future__ import annotations

import json
import posixpath
import re

import pyarrow as pa
import pyarrow.parquet as pq

from cs3ray.models import Tokenizer
from cs3ray.models.tokenizer_load import fingerprint
from cs3ray.storage import Storage, StorageError, open_url

from .corpus import STDLIB, DataError
from .shards import MANIFEST, TOKEN_COLUMN, parse_manifest, shard_tokenizer

# Every shard set has it (the train split is never empty, and its shards are numbered from 0), so a folder
# holding it without a manifest is an unfinished preparation, not a corpus.
FIRST_SHARD = "train-00000.parquet"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def find_prepared(source: str, options: dict | None = None) -> tuple[Storage, dict] | None:
    """(storage, manifest) of the shard set `source` names; None when `source` is a corpus.

    A folder is a shard set when its manifest.json says so (a JSON object with a format_version) or when it
    holds a first shard of cs3ray's; a corpus folder with a manifest.json or a train-00000.parquet of its own
    stays a corpus.
    """
    if source == STDLIB:
        return None
    storage = open_url(source, options)
    storage.fs.invalidate_cache(storage.root)  # a listing this process cached before the set was made would hide it
    if not storage.exists(MANIFEST):
        if _holds_first_shard(storage):
            raise DataError(f"data.source '{storage.url}' holds shards but no {MANIFEST}: an unfinished "
                            f"preparation (run `cs3 data prepare SRC {storage.url}` again to finish it).")
        return None
    raw = storage.read_bytes(MANIFEST)
    if not _claims_shard_set(raw) and not _holds_first_shard(storage):
        return None
    return storage, parse_manifest(raw, storage.url)


def _claims_shard_set(raw: bytes) -> bool:
    try:
        doc = json.loads(raw)
    except ValueError:
        return False
    return isinstance(doc, dict) and "format_version" in doc


def _holds_first_shard(storage: Storage) -> bool:
    """Whether the folder holds a first shard of cs3ray's (one binary token column): a corpus' own
    train-00000.parquet of text is not one. Only the parquet footer is read."""
    if not storage.exists(FIRST_SHARD):
        return False
    try:
        with storage.open(FIRST_SHARD) as f:
            return pq.read_schema(f).names == [TOKEN_COLUMN]
    except (OSError, ValueError, pa.ArrowException, StorageError):
        return False


def check_consistent(manifest: dict, url: str) -> None:
    """Refuse a manifest whose parts disagree (a crafted or damaged one), in one sentence naming what."""
    where = f"'{url}/{MANIFEST}'"
    seq_len = manifest.get("seq_len")
    if not _positive(seq_len) or manifest.get("dtype") != "uint16" or "tokenizer" not in manifest:
        raise DataError(f"{where} records no valid seq_len, dtype or tokenizer; prepare the shard set again.")
    names: set[str] = set()
    totals: dict[str, int] = {}
    for split, entries in manifest["splits"].items():
        for e in entries:
            if e["file"] in names:
                raise DataError(f"{where} lists shard '{e['file']}' twice; prepare the shard set again.")
            names.add(e["file"])
            if not _positive(e["samples"]) or not _positive(e["bytes"]) or not _SHA256.fullmatch(e["sha256"]):
                raise DataError(f"{where} lists shard '{e['file']}' with no samples, no bytes or a malformed "
                                "sha256; prepare the shard set again.")
        totals[split] = sum(e["samples"] for e in entries)
    if manifest.get("samples") != totals or manifest.get("tokens") != sum(totals.values()) * (seq_len + 1):
        raise DataError(f"{where} claims sample and token totals its shard entries do not add up to; "
                        "prepare the shard set again.")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_fits(manifest: dict, url: str, tokenizer: Tokenizer, seq_len: int) -> None:
    """Refuse a shard set made with another tokenizer or sequence length than the job's, naming both."""
    stored = shard_tokenizer(manifest, url)
    if fingerprint(stored) != fingerprint(tokenizer) or manifest["seq_len"] != seq_len:
        raise DataError(f"data.source '{url}' was prepared with tokenizer {stored.describe()} and seq_len "
                        f"{manifest['seq_len']}; this job uses tokenizer {tokenizer.describe()} and seq_len "
                        f"{seq_len} (data.tokenizer, train.seq_len).")


def check_listing(storage: Storage, manifest: dict) -> None:
    """Refuse a shard set whose folder lacks a shard its manifest lists, or holds one of another byte size
    (truncated or replaced): one listing, no shard read (the ranks check each shard's sha256 as they read it)."""
    listed = _sizes(storage)
    entries = [e for split in manifest["splits"].values() for e in split]
    missing = [e["file"] for e in entries if e["file"] not in listed]
    if missing:
        raise DataError(f"shard set '{storage.url}' lacks {len(missing)} of the {len(entries)} shards its manifest "
                        f"lists (the first: '{missing[0]}'); prepare it again.")
    for e in entries:
        if listed[e["file"]] != e["bytes"]:
            raise DataError(f"shard '{storage.url}/{e['file']}' holds {listed[e['file']]} bytes, but the manifest "
                            f"lists {e['bytes']} (truncated or replaced); prepare the shard set again.")


def _sizes(storage: Storage) -> dict[str, int]:
    """File name -> byte size of every file directly in the set's folder (a fresh listing, not fsspec's cache)."""
    def listing() -> dict[str, int]:
        storage.fs.invalidate_cache(storage.root)
        return {posixpath.basename(i["name"].rstrip("/")): int(i.get("size") or 0)
                for i in storage.fs.ls(storage.root, detail=True) if i.get("type") != "directory"}
    return storage.call(listing, action="list")


def prepared_shards(source: str, options: dict | None, tokenizer: Tokenizer,
                    seq_len: int) -> tuple[Storage, dict] | None:
    """(storage, manifest) of the prepared shard set `source` names, verified for this job as the module doc
    says; None when `source` is a corpus to prepare."""
    found = find_prepared(source, options)
    if found is None:
        return None
    storage, manifest = found
    check_consistent(manifest, storage.url)
    check_fits(manifest, storage.url, tokenizer, seq_len)
    check_listing(storage, manifest)
    return storage, manifest
