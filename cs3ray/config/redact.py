"""Credentials in storage options never leave memory: every written or printed config goes through here.

A key is a credential when its name (case and separators ignored, the last part of a dotted
key) is or contains one of the words the fsspec backends use for secrets: s3fs's `key`,
`secret`, `token`, botocore's `aws_secret_access_key` / `aws_session_token`, gcsfs's `token`
and `credentials`, adlfs's `account_key`, `sas_token`, `client_secret`, `connection_string`,
passwords of ftp/sftp/smb/http. Matching by word rather than by a fixed list also catches
spellings such as `SSECustomerKey` in `s3_additional_kwargs`; a false match only hides a value.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# Whole names that are credentials (normalized: lower case, letters and digits only).
SECRET_NAMES = frozenset({"key", "pkey", "sas", "auth", "credential", "credentials"})
# Words that make any name a credential: secret_key, aws_session_token, account_key, db_password...
SECRET_WORDS = ("secret", "token", "password", "passwd", "passphrase", "credential", "connectionstring",
                "accesskey", "accountkey", "privatekey", "apikey", "customerkey", "signature")


def _normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.rsplit(".", 1)[-1].lower())


def is_secret(name: Any) -> bool:
    """Whether a storage option named `name` holds a credential (case-insensitive, any backend)."""
    n = _normalized(str(name))
    return n in SECRET_NAMES or any(word in n for word in SECRET_WORDS)


def redact_options(options: Any) -> Any:
    """A copy of `options` with every credential's value, at any depth, replaced by '***'."""
    if isinstance(options, dict):
        return {k: (MASK if v not in (None, "") and is_secret(k) else redact_options(v)) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return [redact_options(v) for v in options]
    return options


def strip_masked(options: Any) -> Any:
    """A copy of `options` without the entries a redacted config holds ('***'): they are no credentials.

    So a config.yaml copied from a run loads as one that leaves credentials to overrides or
    the backend's own chain, rather than sending '***' as a key.
    """
    if isinstance(options, dict):
        return {k: strip_masked(v) for k, v in options.items() if v != MASK}
    if isinstance(options, list):
        return [strip_masked(v) for v in options]
    return options


def redact_config(data: dict) -> dict:
    """A copy of a config mapping (a JobConfig's JSON dump or parsed YAML) with storage.options redacted."""
    storage = data.get("storage")
    if not isinstance(storage, dict) or "options" not in storage:
        return dict(data)
    return {**data, "storage": {**storage, "options": redact_options(storage["options"])}}


__all__ = ["MASK", "is_secret", "redact_config", "redact_options", "strip_masked"]
