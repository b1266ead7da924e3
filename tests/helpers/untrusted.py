"""Checkpoints from an untrusted source: pickled payloads planted past the checksum gate, and a model factory."""

from __future__ import annotations

import hashlib
import json
import pathlib
import pickle
from pathlib import Path

from cs3ray.ckpt import verify
from cs3ray.ckpt.chunks import METADATA
from cs3ray.ckpt.dcp_metadata import load_metadata
from cs3ray.ckpt.manifest import MANIFEST
from cs3ray.storage import open_url


class Touch:
    """Unpickling this creates `path` (what a real attack would do with os.system)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


class OpenForWrite(Touch):
    def __reduce__(self):
        return open, (str(self.path), "w")


def plant(folder: Path, name: str, blob: bytes) -> None:
    """Replace a checkpoint file and make the manifest list the new bytes, so only the unpickler can stop it."""
    (folder / name).write_bytes(blob)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    verify(open_url(str(folder)))  # the checksum gate passes


def crafted_metadata(folder: Path, payload) -> bytes:
    """The folder's real metadata with `payload` inside it."""
    metadata = load_metadata((folder / METADATA).read_bytes(), "ours")
    metadata.planner_data = {"hint": payload}
    return pickle.dumps(metadata)


def write_target_module(folder: Path) -> tuple[str, Path]:
    """A model factory module `mymodels` in `folder` whose build touches a marker; (model.target, marker)."""
    marker = folder / "target-ran"
    (folder / "mymodels.py").write_text(
        "import pathlib\n"
        "from cs3ray.config.schema import ModelConfig\n"
        "from cs3ray.models import Transformer\n\n\n"
        "def build(section):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    return Transformer(ModelConfig(**section).args())\n")
    return "mymodels:build", marker
