"""Credentials never leave memory: every written or printed config, event and manifest goes through here.

Two rules. By name, inside `storage.options` (the fsspec options, at any depth, headers
included): a key is a credential when its name (case and separators ignored, the last part of
a dotted key) is or contains one of the words the fsspec backends and HTTP use for secrets:
s3fs's `key`, `secret`, `token`, botocore's `aws_secret_access_key` / `aws_session_token`,
gcsfs's `token` and `credentials` (a dict or a file's JSON), adlfs's `account_key`, `sas_token`,
`client_secret`, `connection_string`, OAuth's `access_token` / `refresh_token` / `id_token`,
sftp's `password`, `pkey` and `private_key`, HTTP's `Authorization`, `Cookie` and `X-Api-Key`
headers (also as `[name, value]` pairs). Matching by word rather than by a fixed list also
catches spellings such as `SSECustomerKey`; a false match only hides a value. By value, anywhere
in a config (`run.dir`, `checkpoint.replicas`, `train.init_from`, `data.*`) or a manifest
(`imported_from`): the password of a `scheme://user:password@host` URL and a PEM private key;
in storage.options also an HTTP `Bearer`/`Basic` credential under any name.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# Whole names that are credentials (normalized: lower case, letters and digits only).
SECRET_NAMES = frozenset({"key", "pkey", "sas", "auth", "credential", "credentials", "sshkey"})
# Words that make any name a credential: secret_key, aws_session_token, account_key, db_password...
SECRET_WORDS = ("secret", "token", "password", "passwd", "passphrase", "credential", "connectionstring",
                "accesskey", "accountkey", "privatekey", "apikey", "customerkey", "signature", "authorization",
                "cookie")
# scheme://user:password@host - the password runs to the authority's last '@' (RFC 3986 userinfo).
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*):(?P<password>[^/?#\s]*)@")
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
_HTTP_CREDENTIAL = re.compile(r"^\s*(Bearer|Basic|Digest|Token)\s+\S", re.IGNORECASE)


def _normalized(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.rsplit(".", 1)[-1].lower())


def is_secret(name: Any) -> bool:
    """Whether a storage option named `name` holds a credential (case-insensitive, any backend)."""
    n = _normalized(str(name))
    return n in SECRET_NAMES or any(word in n for word in SECRET_WORDS)


def redact_value(value: Any) -> Any:
    """`value` with what looks like a credential hidden: a URL's password, a PEM private key."""
    if not isinstance(value, str):
        return value
    if _PRIVATE_KEY.search(value):
        return MASK
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@" if m["password"] != MASK else m[0], value)


def redact_values(data: Any) -> Any:
    """A copy of `data` (JSON-like) with every string passed through `redact_value`; keys are kept."""
    if isinstance(data, dict):
        return {k: redact_values(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_values(v) for v in data]
    return redact_value(data)


def _is_header_pair(item: Any) -> bool:
    # requests/aiohttp also take headers as [(name, value), ...].
    return isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and is_secret(item[0])


def redact_options(options: Any) -> Any:
    """A copy of `options` with every credential's value, at any depth, replaced by '***'."""
    if isinstance(options, dict):
        return {k: (MASK if v not in (None, "") and is_secret(k) else redact_options(v)) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        if _is_header_pair(options) and options[1] not in (None, ""):
            return [options[0], MASK]
        return [redact_options(v) for v in options]
    # An option's value alone may be a header's (an `Authorization` value under another name).
    return MASK if isinstance(options, str) and _HTTP_CREDENTIAL.match(options) else redact_value(options)


def strip_masked(options: Any) -> Any:
    """A copy of `options` without the entries a redacted config holds ('***'): they are no credentials.

    So a config.yaml copied from a run loads as one that leaves credentials to overrides or
    the backend's own chain, rather than sending '***' as a key.
    """
    if isinstance(options, dict):
        return {k: strip_masked(v) for k, v in options.items() if v != MASK}
    if isinstance(options, list):
        return [strip_masked(v) for v in options if not (_is_header_pair(v) and v[1] == MASK)]
    return options


def redact_config(data: dict) -> dict:
    """A copy of a config mapping (a JobConfig's JSON dump or parsed YAML): storage.options by name, all by value."""
    out = redact_values({k: v for k, v in data.items() if k != "storage"})
    storage = data.get("storage")
    if "storage" in data:
        out["storage"] = redact_values(storage)
        if isinstance(storage, dict) and "options" in storage:
            out["storage"]["options"] = redact_options(storage["options"])
    return {k: out[k] for k in data}  # the file's order


def secret_fields(data: Any, redacted: Any = None, where: str = "") -> list[str]:
    """The dotted names of the fields of a config mapping that hold a credential (what redact_config hides)."""
    redacted = redact_config(data) if redacted is None and isinstance(data, dict) else redacted
    if isinstance(data, dict) and isinstance(redacted, dict):
        return [name for k in data for name in secret_fields(data[k], redacted.get(k), f"{where}.{k}".lstrip("."))]
    if isinstance(data, (list, tuple)) and isinstance(redacted, list) and len(data) == len(redacted):
        return [name for i, (a, b) in enumerate(zip(data, redacted, strict=True)) for name in secret_fields(a, b, f"{where}[{i}]")]
    return [] if data == redacted else [where]


__all__ = ["MASK", "is_secret", "redact_config", "redact_options", "redact_value", "redact_values", "secret_fields",
           "strip_masked"]
