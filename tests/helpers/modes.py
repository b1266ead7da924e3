"""File modes below a folder: what is not its owner's alone."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def not_private(root: Path) -> list[str]:
    """Every file readable or writable by group or others, and every folder that is not 0700, below `root`."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            mode = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
            if mode != 0o700:
                found.append(f"{os.path.join(folder, name)} {mode:o}")
        for name in files:
            mode = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
            if mode & 0o077:
                found.append(f"{os.path.join(folder, name)} {mode:o}")
    return found
