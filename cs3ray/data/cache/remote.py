"""L3: the shard set's own URL (s3://, gs://, file://, memory://), read with retries up to a deadline."""

from __future__ import annotations

from typing import Callable

from cs3ray.storage import DeadlineExceeded, Storage, retry, short_error

from .errors import CacheError


class RemoteTier:
    """Whole-file reads from an fsspec Storage; transient errors retried, then one clear error."""

    def __init__(self, storage: Storage, deadline_s: float = 60.0) -> None:
        self.storage, self.deadline_s = storage, deadline_s

    def url(self, name: str) -> str:
        return self.storage.child(name).url

    def read(self, name: str, on_retry: Callable[[BaseException], None] | None = None) -> bytes:
        fs, path = self.storage.fs, self.storage.path(name)
        try:
            return retry(lambda: fs.cat_file(path), self.deadline_s, permanent=(FileNotFoundError, PermissionError),
                         on_retry=on_retry)
        except FileNotFoundError:
            raise CacheError(f"shard '{self.url(name)}' does not exist; the shard set is incomplete "
                             "(prepare it again).") from None
        except PermissionError as exc:
            raise CacheError(f"no permission to read shard '{self.url(name)}': {exc}.") from None
        except DeadlineExceeded as exc:
            raise CacheError(f"could not read shard '{self.url(name)}' within {self.deadline_s:g}s "
                             f"({exc.attempts} attempts; last error: {short_error(exc.last)}); check that the storage "
                             "is reachable, or raise cache.retry_deadline_s.") from None

