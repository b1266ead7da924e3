"""Bearer-token auth for the API (optional: no token configured means an open server)."""

from __future__ import annotations

import hmac

from .schemas import APIError


def check_bearer(token: str | None, header: str | None) -> None:
    """Raise a 401 unless `header` is 'Bearer <token>'; compared in constant time."""
    if token is None:
        return
    scheme, _, given = (header or "").partition(" ")
    # compare_digest on bytes of both sides: its run time does not depend on where they differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "missing or wrong API key; send 'Authorization: Bearer <token>'",
                       "authentication_error", code="invalid_api_key")
