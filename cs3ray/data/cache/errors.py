"""The cache's one user-facing error."""

from cs3ray.errors import UserError


class CacheError(UserError):
    """A shard could not be served (storage unreachable, missing, corrupt at the source); names the URL."""
