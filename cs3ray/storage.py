"""One way to reach any storage URL (local path, file://, s3://, gs://, memory://) with fsspec.

Run directories, checkpoints and data shards all go through here so the same storage options
(endpoints, credentials) apply everywhere and errors name the URL. Every operation is retried
with jittered exponential backoff on transient errors (a dropped connection, a 503, a request
that hangs) until a deadline, and never on permanent ones (a missing file, no permission, a full
disk), which fail at once; either way the caller gets one StorageError naming the URL.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import posixpath
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fsspec.core import url_to_fs

from cs3ray import direct_io
from cs3ray.errors import UserError

T = TypeVar("T")
log = logging.getLogger(__name__)
RETRY_DEADLINE_S = 60.0
# Retrying cannot fix these: the thing is absent, forbidden, or the request itself is wrong.
PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
                   UserError, ValueError, TypeError, KeyError, AttributeError, NotImplementedError)
PERMANENT_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                              errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG})
PERMANENT_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "ParamValidationError"})  # botocore
# What cs3 writes locally (configs, checkpoints, events, shards, the cache) is its owner's alone; the modes
# are given where each file and folder is created, so no process-wide umask touches Ray's own logs.
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
# The retry loop's clock and sleep, looked up at each call: tests stand in for them rather than time the host.
_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep


class StorageError(UserError):
    """Storage could not be reached or a file is missing; the message names the URL."""


class DeadlineExceeded(Exception):
    """Every attempt failed (or hung) until the deadline; carries the last error and attempt count."""

    def __init__(self, last: BaseException | None, attempts: int, seconds: float) -> None:
        super().__init__(str(last) if last else "timed out")
        self.last, self.attempts, self.seconds = last, attempts, seconds


def is_permanent(exc: BaseException) -> bool:
    """True for errors that another attempt cannot fix (missing, forbidden, disk full, bad request)."""
    return (isinstance(exc, PERMANENT_TYPES) or getattr(exc, "errno", None) in PERMANENT_ERRNOS
            or type(exc).__name__ in PERMANENT_NAMES)


def _bounded(fn: Callable[[], T], timeout: float) -> T:
    # A hung request must not outlive the deadline: run it in a daemon thread and stop waiting.
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name="cs3-io")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:.1f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def retry(fn: Callable[[], T], deadline_s: float,
          permanent: tuple[type[BaseException], ...] | Callable[[BaseException], bool] = is_permanent,
          on_retry: Callable[[BaseException], None] | None = None,
          base_s: float = 0.1, max_sleep_s: float = 2.0, bounded: bool = True) -> T:
    """`fn()`, retried with jittered exponential backoff until `deadline_s` has passed.

    With `bounded`, each attempt runs in a helper thread and is abandoned when it outlives the
    deadline (a hung request). Errors that `permanent` matches (exception types, or a predicate)
    are raised at once; the last transient one rides on DeadlineExceeded.
    """
    perm = permanent if callable(permanent) else (lambda exc: isinstance(exc, permanent))
    start = _clock()
    attempt, last = 0, None
    while True:
        left = deadline_s - (_clock() - start)
        if left <= 0:
            raise DeadlineExceeded(last, attempt, _clock() - start)
        attempt += 1
        try:
            return _bounded(fn, left) if bounded else fn()
        except Exception as exc:  # noqa: BLE001 - storage clients raise many types; transient ones are retried
            if perm(exc):
                raise
            last = exc
            if on_retry:
                on_retry(exc)
        sleep = min(max_sleep_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        _sleep(max(0.0, min(sleep, deadline_s - (_clock() - start))))


def short_error(exc: BaseException | None) -> str:
    """The first line of an error's message (or its type), at most 200 characters."""
    if exc is None:
        return "timed out"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def sync_filesystem(path: str) -> None:
    """Flush the filesystem holding `path` (its nearest existing folder) to stable storage."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    syncfs = getattr(_libc(), "syncfs", None)
    if syncfs is None:  # not Linux: flush every filesystem instead
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def makedirs_private(path: str) -> None:
    """Create folder `path` and its missing parents as 0700 folders (existing ones keep their mode).

    os.makedirs applies its mode to the last folder only; the parents it creates get the umask's.
    """
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        if os.path.dirname(path) == path:
            break
        path = os.path.dirname(path)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_DIR)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise


def open_private(path: str, mode: str = "wb"):
    """open(path, mode) for writing ('w', 'a' or 'x', text or binary), a new file created 0600."""
    flags = os.O_WRONLY | os.O_CREAT | {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}[mode[0]]
    return os.fdopen(os.open(path, flags, PRIVATE_FILE), mode)


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
    options: dict[str, Any] = field(default_factory=dict, repr=False)  # credentials: kept out of logs
    retry_deadline_s: float = RETRY_DEADLINE_S

    def __post_init__(self) -> None:
        if "://" not in self.url:
            self.url = os.path.abspath(self.url)
        try:
            self.fs, self.root = url_to_fs(self.url, **_flatten_options(self.options))
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open storage '{self.url}': {exc}") from None

    def child(self, *parts: str) -> "Storage":
        return Storage(join(self.url, *parts), self.options, self.retry_deadline_s)

    def path(self, *parts: str) -> str:
        """Filesystem path (protocol stripped) of a file below the root."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def exists(self, *parts: str) -> bool:
        return self.call(lambda: self.fs.exists(self.path(*parts)), *parts, action="check")

    def read_bytes(self, *parts: str) -> bytes:
        return self.call(lambda: self.fs.cat_file(self.path(*parts)), *parts, action="read")

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode()

    def write_bytes(self, data: Any, *parts: str, durable: bool = True) -> None:
        """Write bytes (or any contiguous buffer) to a file so no reader ever sees it half-written.

        Local files go to a temp name and are renamed; object stores commit a PUT atomically.
        `durable=False` skips the local file's fsync: for many files written together, one
        `sync()` afterwards is far cheaper, and nothing may point at them until it has run.
        """
        target = self.path(*parts)

        def write() -> None:
            parent = posixpath.dirname(target)
            if is_remote(self.url):
                if parent:
                    self.fs.makedirs(parent, exist_ok=True)
                self.fs.pipe_file(target, data if isinstance(data, bytes) else memoryview(data).tobytes())
                return
            if parent:
                makedirs_private(parent)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            # Large files (checkpoint chunks) bypass the page cache: far less CPU per byte.
            if memoryview(data).nbytes < direct_io.MIN_BYTES or not direct_io.write_direct(tmp, data, durable):
                with open_private(tmp, "wb") as f:
                    f.write(data)
                    if durable:
                        f.flush()
                        os.fsync(f.fileno())
            os.replace(tmp, target)

        self.call(write, *parts, action="write")

    def write_text(self, text: str, *parts: str) -> None:
        self.write_bytes(text.encode(), *parts)

    def sync(self) -> None:
        """Make every file written below this root with `durable=False` durable (renames included).

        Locally one syncfs of the root's filesystem: a checkpoint's hundreds of chunk files then
        cost one journal commit instead of one each, less of the training step (figures:
        docs/benchmarks.md). Object stores need nothing: a PUT is durable once it returns.
        """
        if is_remote(self.url):
            return
        self.call(lambda: sync_filesystem(self.path()), action="sync")

    def ls(self, *parts: str) -> list[str]:
        """Names (not paths) directly below a folder; empty when it does not exist."""
        def listing() -> list[str]:
            p = self.path(*parts)
            if not self.fs.exists(p):
                return []
            return sorted(posixpath.basename(x.rstrip("/")) for x in self.fs.ls(p, detail=False))
        return self.call(listing, *parts, action="list")

    def rm(self, *parts: str, missing_ok: bool = False) -> None:
        def remove() -> None:
            try:
                self.fs.rm(self.path(*parts), recursive=True)
            except FileNotFoundError:
                if not missing_ok:
                    raise
        self.call(remove, *parts, action="delete")

    def makedirs(self, *parts: str) -> None:
        if not is_remote(self.url):
            self.call(lambda: makedirs_private(self.path(*parts)), *parts, action="create")
            return
        self.call(lambda: self.fs.makedirs(self.path(*parts), exist_ok=True), *parts, action="create")

    def open(self, *parts: str, mode: str = "rb"):
        if not is_remote(self.url) and mode[0] in "wax":
            return self.call(lambda: open_private(self.path(*parts), mode), *parts, action="open")
        return self.call(lambda: self.fs.open(self.path(*parts), mode), *parts, action="open")

    def call(self, fn: Callable[[], T], *parts: str, action: str = "access") -> T:
        """`fn()` on the file at `parts`, retried on transient errors; failures become one StorageError."""
        where = join(self.url, *parts)

        def note(exc: BaseException) -> None:
            log.warning("retrying %s of '%s' after: %s", action, where, short_error(exc))

        try:
            # Local files are read and written in the calling thread (at its priority); only
            # network requests, which can hang, get a helper thread bounded by the deadline.
            return retry(fn, self.retry_deadline_s, on_retry=note, bounded=is_remote(self.url))
        except FileNotFoundError:
            raise StorageError(f"'{where}' does not exist.") from None
        except PermissionError as exc:
            raise StorageError(f"no permission for '{where}': {short_error(exc)}.") from None
        except DeadlineExceeded as exc:
            raise StorageError(f"could not {action} '{where}' within {self.retry_deadline_s:g}s ({exc.attempts} "
                               f"attempts; last error: {short_error(exc.last)}); check that the storage is "
                               "reachable.") from None
        except OSError as exc:
            raise StorageError(f"storage error at '{where}': {short_error(exc)}.") from None


def open_url(url: str, options: dict[str, Any] | None = None, retry_deadline_s: float = RETRY_DEADLINE_S) -> Storage:
    """A Storage rooted at `url` with fsspec `options`."""
    return Storage(url, dict(options or {}), retry_deadline_s)


__all__ = ["DeadlineExceeded", "PRIVATE_DIR", "PRIVATE_FILE", "RETRY_DEADLINE_S", "Storage", "StorageError",
           "is_permanent", "is_remote", "join", "makedirs_private", "open_private", "open_url", "retry", "short_error"]
