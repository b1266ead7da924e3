"""Checkpoint manifests: the file list with sizes and sha256, written last.

A checkpoint folder without a valid manifest does not exist as far as cs3ray is concerned, so
a crash half-way through a save can never be mistaken for a checkpoint.

The checksums prove integrity, not authorship: whoever can write the folder can rewrite the
manifest to match. So loading never trusts the bytes it verified: `.metadata` is unpickled
admitting DCP's classes only (dcp_metadata), and a model.target in the folder's config is
imported only when the user passes --trust-code.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from cs3ray.errors import UserError
from cs3ray.names import check_hex, check_name
from cs3ray.storage import Storage

# 2: chunks are named by XXH3-128 (32 hex digits); format-1 folders (sha256-named chunks) still load.
FORMAT_VERSION = 2
READS_FORMATS = (1, 2)
MANIFEST = "manifest.json"


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete or corrupt; the message names it."""


def sha256_of(storage: Storage, name: str) -> tuple[int, str]:
    """(size, sha256) of one file, streamed so large shards never sit in memory twice (retried whole)."""
    def stream() -> tuple[int, str]:
        h = hashlib.sha256()
        size = 0
        with storage.fs.open(storage.path(name), "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    return storage.call(stream, name, action="read")


def write_manifest(folder: Storage, step: int, world_size: int, extra: dict[str, Any]) -> dict:
    """Checksum every file in `folder` and commit the manifest (atomically, last)."""
    files = {}
    for name in folder.ls():
        if name == MANIFEST or ".tmp-" in name:
            continue
        size, digest = sha256_of(folder, name)
        files[name] = {"size": size, "sha256": digest}
    manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
                "created": time.time(), "files": files, **extra}
    folder.write_text(json.dumps(manifest, indent=1, sort_keys=True), MANIFEST)
    return manifest


def read_manifest(folder: Storage) -> dict:
    """The manifest of a checkpoint folder, or CheckpointError when it is absent or unreadable."""
    if not folder.exists(MANIFEST):
        raise CheckpointError(f"'{folder.url}' has no {MANIFEST}: it is not a complete checkpoint.")
    try:
        manifest = json.loads(folder.read_text(MANIFEST))
        if manifest["format_version"] not in READS_FORMATS:
            raise CheckpointError(f"'{folder.url}' has checkpoint format {manifest['format_version']}; "
                                  f"this cs3ray reads formats {', '.join(map(str, READS_FORMATS))}.")
        manifest["files"], manifest["step"]  # noqa: B018 - required keys
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"'{folder.url}/{MANIFEST}' is corrupt.") from None
    check_listing(manifest, f"'{folder.url}/{MANIFEST}'")
    return manifest


def check_listing(manifest: dict, source: str) -> None:
    """Every file a manifest lists is a plain name in its folder and every chunk an id, with sizes that are
    byte counts: checked before any of them becomes a path (a crafted manifest must not name `../x`)."""
    files, chunks = manifest.get("files"), manifest.get("chunks", {})
    if not isinstance(files, dict) or not isinstance(chunks, dict):
        raise CheckpointError(f"{source} is corrupt (its files or chunks are not a mapping).")
    for name, meta in files.items():
        check_name(name, source, CheckpointError)
        if not isinstance(meta, dict) or not _count(meta.get("size")) or not isinstance(meta.get("sha256"), str):
            raise CheckpointError(f"{source} is corrupt (the entry of '{name}' has no byte size and sha256).")
    for h, size in chunks.items():
        check_hex(h, source, CheckpointError)
        if not _count(size):
            raise CheckpointError(f"{source} is corrupt (chunk {h[:12]} has size {size!r}, not a byte count).")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify(folder: Storage, manifest: dict | None = None) -> dict:
    """Check every file's size and sha256 against the manifest before anything reads it."""
    manifest = manifest or read_manifest(folder)
    present = set(folder.ls())
    for name, meta in sorted(manifest["files"].items()):
        if name not in present:
            raise CheckpointError(f"checkpoint '{folder.url}' is missing '{name}'.")
        size, digest = sha256_of(folder, name)
        if size != meta["size"] or digest != meta["sha256"]:
            raise CheckpointError(f"checkpoint file '{folder.url}/{name}' does not match its checksum "
                                  f"(corrupt or truncated).")
    return manifest
