"""Where a run lives: the one definition of `runs/<name>`."""

from __future__ import annotations

import os

from cs3ray.storage import Storage, StorageError, open_url

RUNS_DIR = "runs"


def run_dir(name: str) -> str:
    """The default directory of the run called `name`: runs/<name>, below the working directory."""
    return os.path.join(RUNS_DIR, name)


def resolve_run(run: str) -> str:
    """A RUN argument -> URL: a bare name means run_dir(name); paths and URLs are taken as they are."""
    if "://" in run or os.sep in run or os.path.exists(run):
        return run
    return run_dir(run)


def open_run(run: str, storage_options: dict | None, error: type[Exception]) -> Storage:
    """The folder of an existing run; `error` with one sentence when it is missing or unreachable."""
    storage = open_url(resolve_run(run), storage_options)
    try:
        exists = storage.exists()
    except StorageError as exc:
        raise error(str(exc)) from None
    if not exists:
        raise error(f"run '{run}' does not exist (looked at '{storage.url}').")
    return storage
