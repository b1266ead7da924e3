"""One way to reach any storage URL (local path, file://, s3://, gs://, memory://) with fsspec.

Run directories, checkpoints and data shards all go through here so the same storage options
(endpoints, credentials) apply everywhere and errors name the URL.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

from cs3ray.errors import UserError


class StorageError(UserError):
    """Storage could not be reached or a file is missing; the message names the URL."""


def is_remote(url: str) -> bool:
    """True for URLs with a non-local protocol (s3://, gs://, memory://...)."""
    proto = url.split("://", 1)[0] if "://" in url else "file"
    return proto not in ("file", "local")


def join(base: str, *parts: str) -> str:
    """Join path parts onto a URL or local path."""
    if "://" in base:
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


def _flatten_options(options: dict[str, Any]) -> dict[str, Any]:
    # Users write `client_kwargs.endpoint_url` in YAML overrides; fsspec wants nested dicts.
    out: dict[str, Any] = {}
    for key, value in options.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


@dataclass
class Storage:
    """A base URL plus the storage options to reach it."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "://" not in self.url:
            self.url = os.path.abspath(self.url)
        try:
            self.fs, self.root = url_to_fs(self.url, **_flatten_options(self.options))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open storage '{self.url}': {exc}") from None

    def child(self, *parts: str) -> "Storage":
        return Storage(join(self.url, *parts), self.options)

    def path(self, *parts: str) -> str:
        """Filesystem path (protocol stripped) of a file below the root."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def exists(self, *parts: str) -> bool:
        return self._guard(lambda: self.fs.exists(self.path(*parts)), parts)

    def read_bytes(self, *parts: str) -> bytes:
        return self._guard(lambda: self.fs.cat_file(self.path(*parts)), parts)

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a file so no reader ever sees it half-written.

        Local files go to a temp name and are renamed; object stores commit a PUT atomically.
        """
        target = self.path(*parts)

        def write() -> None:
            parent = posixpath.dirname(target)
            if parent:
                self.fs.makedirs(parent, exist_ok=True)
            if is_remote(self.url):
                self.fs.pipe_file(target, data)
                return
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)

        self._guard(write, parts)

    def write_text(self, text: str, *parts: str) -> None:
        self.write_bytes(text.encode(), *parts)

    def ls(self, *parts: str) -> list[str]:
        """Names (not paths) directly below a folder; empty when it does not exist."""
        def listing() -> list[str]:
            p = self.path(*parts)
            if not self.fs.exists(p):
                return []
            return sorted(posixpath.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))
        return self._guard(listing, parts)

    def rm(self, *parts: str) -> None:
        self._guard(lambda: self.fs.rm(self.path(*parts), recursive=True), parts)

    def makedirs(self, *parts: str) -> None:
        self._guard(lambda: self.fs.makedirs(self.path(*parts), exist_ok=True), parts)

    def open(self, *parts: str, mode: str = "rb"):
        return self._guard(lambda: self.fs.open(self.path(*parts), mode), parts)

    def _guard(self, fn, parts):
        try:
            return fn()
        except FileNotFoundError:
            raise StorageError(f"'{join(self.url, *parts)}' does not exist.") from None
        except PermissionError as exc:
            raise StorageError(f"no permission for '{join(self.url, *parts)}': {exc}.") from None
        except OSError as exc:
            raise StorageError(f"storage error at '{join(self.url, *parts)}': {exc}.") from None


def open_url(url: str, options: dict[str, Any] | None = None) -> Storage:
    """A Storage rooted at `url` with fsspec `options`."""
    return Storage(url, dict(options or {}))


__all__ = ["Storage", "StorageError", "is_remote", "join", "open_url"]
