"""Where a run lives: the one definition of `runs/<name>`."""

from __future__ import annotations

import os

RUNS_DIR = "runs"


def run_dir(name: str) -> str:
    """The default directory of the run called `name`: runs/<name>, below the working directory."""
    return os.path.join(RUNS_DIR, name)


def resolve_run(run: str) -> str:
    """A RUN argument -> URL: a bare name means run_dir(name); paths and URLs are taken as they are."""
    if "://" in run or os.sep in run or os.path.exists(run):
        return run
    return run_dir(run)
