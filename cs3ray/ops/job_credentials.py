"""No credential in a Ray job's entrypoint, runtime_env or uploaded config: what `cs3 submit` and jobs/train.py refuse.

A job's entrypoint and runtime_env (its `env_vars` included) are stored in the cluster's job
table: `ray job list`, `cs3 jobs ls` and the dashboard show them to everyone who reaches the job
API, and Ray logs the entrypoint. The working dir is uploaded into the cluster and unpacked on
every node that runs the job. Credentials belong to the backend's own chain on the cluster.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Iterable

from cs3ray.config import ConfigError, apply_overrides
from cs3ray.config.loader import read_yaml
from cs3ray.config.redact import MASK, redact_value, secret_fields
from cs3ray.errors import UserError

HOW = ("give credentials to the cluster instead, where the storage backend's own chain finds them: environment "
       "variables of `ray start` on every node (on Kubernetes from a Secret), ~/.aws and the like on the nodes, or "
       "the instance's or pod's identity (docs/operations.md, section 7)")
# Environment variables go by whole words: TOKENIZERS_PARALLELISM or MAX_TOKENS are no credentials.
ENV_WORDS = frozenset({"SECRET", "TOKEN", "PASSWORD", "PASSWD", "PASSPHRASE", "APIKEY", "COOKIE", "PAT"})
ENV_PAIRS = frozenset({("ACCESS", "KEY"), ("ACCOUNT", "KEY"), ("PRIVATE", "KEY"), ("API", "KEY"),
                       ("CONNECTION", "STRING"), ("CLIENT", "SECRET")})
SHOWN = "a job's entrypoint and runtime_env are stored in its metadata, which `ray job list` shows"


class CredentialInJobError(UserError):
    """A credential would be stored in a job's metadata or uploaded with its working dir."""


def check_overrides(overrides: Iterable[str], where: str = "on the command line") -> None:
    """Refuse an override that sets a credential (names only in the message: never the value)."""
    for text in overrides:
        try:
            fields = secret_fields(apply_overrides({}, [text]))
        except ConfigError:
            continue  # a malformed override: the config loader says what is wrong with it
        if fields:
            raise CredentialInJobError(f"refusing the credential in '{fields[0]}' {where}: {SHOWN}; {HOW}.")


def check_config_file(path: str | Path) -> None:
    """Refuse a config file that holds a credential: it is uploaded with the job's working dir."""
    try:
        fields = secret_fields(read_yaml(path))
    except ConfigError:
        return  # the config loader refuses it with its own message
    if fields:
        raise CredentialInJobError(f"refusing config '{path}': '{fields[0]}' holds a credential, and the file would "
                                   f"be uploaded to the cluster with the job's working dir; remove it and {HOW}.")


def is_secret_variable(name: str) -> bool:
    """Whether an environment variable named `name` holds a credential (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...)."""
    words = [w for w in re.split(r"[^A-Z0-9]+", name.upper()) if w]
    return bool(ENV_WORDS.intersection(words)) or any(pair in ENV_PAIRS for pair in zip(words, words[1:], strict=False))


def check_env_vars(env_vars: dict[str, str]) -> None:
    """Refuse a job environment variable that holds a credential (the runtime_env is job metadata)."""
    for key, value in env_vars.items():
        if is_secret_variable(key) or redact_value(value) != value:
            raise CredentialInJobError(f"refusing --env {key}: {SHOWN}, so a credential must not be one of its "
                                       f"environment variables; {HOW}.")


def redact_entrypoint(text: str) -> str:
    """A job's entrypoint as `cs3 jobs` shows it: credentials that others' submissions put there as '***'."""
    try:
        words = shlex.split(text)
    except ValueError:  # unbalanced quotes: hide what looks like a credential in the text as it is
        return redact_value(text)
    shown = []
    for word in words:
        key, sep, value = word.partition("=")
        try:
            secret = bool(sep) and bool(secret_fields(apply_overrides({}, [word])))
        except ConfigError:
            secret = False
        masked = redact_value(value) if secret and redact_value(value) != value else MASK  # a URL keeps its host
        shown.append(f"{key}={masked}" if secret else redact_value(word))
    return text if shown == words else shlex.join(shown)


__all__ = ["CredentialInJobError", "check_config_file", "check_env_vars", "check_overrides", "is_secret_variable",
           "redact_entrypoint"]
