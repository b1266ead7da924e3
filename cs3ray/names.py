"""File names read from storage (manifests, indexes, chunk ids), checked before they become paths.

A manifest is data whoever can write the folder can rewrite, and the checksums it lists prove
nothing about who wrote it; a name such as `../../x` or `/etc/passwd`, joined to the folder,
would read or write outside it. So every name a reader takes from a stored file passes here
first: one file directly in its folder, never a path.
"""

from __future__ import annotations

import re

from cs3ray.errors import UserError

# What cs3ray itself writes into checkpoint folders and shard sets (`.metadata`, `step-...`, `train-00001.parquet`).
OUR_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
HEX_LENGTHS = (32, 64)  # a chunk id: XXH3-128 (format 2) or sha256 (format 1)
_HEX = re.compile(r"[0-9a-f]+")


def _problem(name: object, ours: bool) -> str | None:
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name:
        return "is empty"
    if "\0" in name:
        return "holds a NUL byte"
    if "/" in name or "\\" in name:
        return "is a path, not a file name"
    if ".." in name or name == ".":
        return "climbs out of its folder"  # `..` anywhere: no name cs3ray or Hugging Face writes holds it
    if re.match(r"[A-Za-z]:", name) or name.startswith("~"):
        return "is an absolute path"
    if ours and not OUR_NAME.fullmatch(name):
        return "holds characters cs3ray never writes in a file name"
    return None


def check_name(name: object, source: str, error: type[UserError] = UserError, ours: bool = True) -> str:
    """`name` when it is one plain file name; else `error` naming `source` (the manifest or index).

    `ours`: the file is one cs3ray writes, so only its characters (letters, digits, `.`, `_`, `-`) pass;
    other formats (a Hugging Face index) may use any character but the path separators, `..` and NUL.
    """
    problem = _problem(name, ours)
    if problem:
        raise error(f"{source} names the file {_shown(name)}, which {problem}; refusing to read it.")
    return name  # type: ignore[return-value]


def check_hex(name: object, source: str, error: type[UserError] = UserError,
              lengths: tuple[int, ...] = HEX_LENGTHS) -> str:
    """`name` when it is lowercase hex of one of `lengths` digits (a chunk id); else `error` naming `source`."""
    if not isinstance(name, str) or len(name) not in lengths or not _HEX.fullmatch(name):
        want = " or ".join(map(str, lengths))
        raise error(f"{source} names the chunk {_shown(name)}, which is not {want} hex digits; refusing to read it.")
    return name


def _shown(name: object) -> str:
    """The name as one short line (repr escapes NUL and newlines)."""
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."
