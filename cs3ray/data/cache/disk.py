"""L2: shard files in a node-local directory, shared by every worker process on the node.

Layout: `<dir>/<namespace>/<shard file>`, a namespace per L3 URL. Whatever is in the
directory *is* the cache state (sizes from stat, last use from mtime), so processes need no
shared index: admission and eviction happen under one directory lock, files are written to
a temp name and renamed (a reader never sees half a file). A file is checked against the
manifest's sha256 the first time this process reads it and whenever its (inode, size, mtime)
changes; a file that fails is dropped and fetched again. Bytes changed in place without moving
mtime are not noticed after that first check.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from dataclasses import dataclass

from cs3ray.names import check_name
from cs3ray.storage import makedirs_private, open_private

from .errors import CacheError
from .locking import file_lock
from .policy import Entry, EvictionPolicy

LOCK = ".index.lock"
TMP = ".tmp-"


@dataclass
class Admission:
    stored: bool
    evicted: int


class DiskTier:
    """A byte-bounded shard directory; safe for many processes at once."""

    def __init__(self, root: str, capacity: int, policy: EvictionPolicy) -> None:
        self.root, self.capacity, self.policy = os.path.abspath(os.path.expanduser(root)), capacity, policy
        makedirs_private(self.root)  # the owner's alone, as everything a run writes locally
        # path -> (inode, size, mtime_ns) of files this process checked or wrote from checked bytes;
        # an unchanged signature means unchanged bytes, so hot epochs skip re-hashing.
        self._verified: dict[str, tuple[int, int, int]] = {}

    def path(self, ns: str, name: str) -> str:
        # `name` comes from a manifest: a path there (os.path.join drops the root before "/x") must not escape.
        return os.path.join(self.root, check_name(ns, "the L2 cache", CacheError),
                            check_name(name, "the shard set's manifest", CacheError))

    def key_lock(self, ns: str, name: str) -> str:
        """Lock file that serialises fetching one shard into the cache (one fetch per node)."""
        return os.path.join(os.path.dirname(self.path(ns, name)), ".locks", name + ".lock")

    def read(self, ns: str, name: str, check) -> bytes | None:
        """The cached bytes if present and `check(bytes)` passes; a failing file is removed."""
        p = self.path(ns, name)
        try:
            with open(p, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        sig = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._verified.get(p) != sig:
            if not check(data):
                self._remove_if_same(p, sig)
                return None
        if self.policy.name == "lru":
            os.utime(p)  # last use, for LRU (the remembered signature follows the new mtime)
            self._remember(p)
        else:
            self._verified[p] = sig
        return data

    def has(self, ns: str, name: str) -> bool:
        return os.path.exists(self.path(ns, name))

    def _remember(self, p: str) -> None:
        # A file keeps its signature until someone writes to it (which moves mtime) or replaces it.
        try:
            st = os.stat(p)
            self._verified[p] = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            self._verified.pop(p, None)

    def _remove_if_same(self, p: str, sig: tuple[int, int, int]) -> None:
        # Another process may have replaced the bad file with a good one meanwhile: keep that.
        with file_lock(os.path.join(self.root, LOCK)):
            try:
                st = os.stat(p)
                if (st.st_ino, st.st_size, st.st_mtime_ns) == sig:
                    os.remove(p)
            except FileNotFoundError:
                pass
        self._verified.pop(p, None)

    def entries(self) -> list[tuple[str, Entry]]:
        """(path, entry) of every cached shard; call with the directory lock held."""
        out = []
        for ns in os.listdir(self.root):
            folder = os.path.join(self.root, ns)
            if ns.startswith(".") or not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                if name.startswith("."):
                    continue
                p = os.path.join(folder, name)
                if TMP in name:
                    # Only the lock holder writes temp files, so any seen here are a crashed writer's.
                    _unlink(p)
                    continue
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                out.append((p, Entry(p, st.st_size, st.st_mtime)))
        return out

    def usage(self) -> tuple[int, int]:
        """(files, bytes) held now."""
        with file_lock(os.path.join(self.root, LOCK)):
            es = self.entries()
        return len(es), sum(e.size for _, e in es)

    def put(self, ns: str, name: str, data: bytes) -> Admission:
        """Admit `data` if the policy lets it, evicting as the policy says; a full disk evicts more."""
        target = self.path(ns, name)
        with file_lock(os.path.join(self.root, LOCK)):
            if os.path.exists(target):
                return Admission(True, 0)
            es = self.entries()
            used = sum(e.size for _, e in es)
            victims = self.policy.victims([e for _, e in es], len(data), used, self.capacity)
            if victims is None:
                return Admission(False, 0)
            for p in victims:
                _unlink(p)
                used -= next(e.size for q, e in es if q == p)
            if used + len(data) > self.capacity:
                return Admission(False, len(victims))
            evicted = len(victims)
            left = sorted((e for p, e in es if p not in set(victims)), key=lambda e: e.last_used)
            while True:
                try:
                    _atomic_write(target, data)
                    self._remember(target)  # written from verified bytes: no need to hash it again
                    return Admission(True, evicted)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not left:
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            return Admission(False, evicted)  # nothing left to evict: serve uncached
                        raise
                    # The disk is fuller than our byte bound assumed (other users): evict, don't fail.
                    _unlink(left.pop(0).key)
                    evicted += 1

    def drop(self, ns: str, name: str) -> None:
        with file_lock(os.path.join(self.root, LOCK)):
            _unlink(self.path(ns, name))

    def clear(self) -> int:
        """Remove every cached shard; returns the bytes freed."""
        with file_lock(os.path.join(self.root, LOCK)):
            es = self.entries()
            for p, _ in es:
                _unlink(p)
        return sum(e.size for _, e in es)


def _atomic_write(target: str, data: bytes) -> None:
    makedirs_private(os.path.dirname(target))
    tmp = os.path.join(os.path.dirname(target), f"{os.path.basename(target)}{TMP}{uuid.uuid4().hex[:8]}")
    try:
        with open_private(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        os.utime(target, (time.time(), time.time()))
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(p: str) -> None:
    try:
        os.remove(p)
    except FileNotFoundError:
        pass
