"""Checkpoints and shard sets from an untrusted source: pickled payloads planted past the checksum gate, a model
factory, and stored names that climb out of their folder."""

from __future__ import annotations

import hashlib
import json
import os
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


SECRET = "a file outside every folder under test\n"
# The fields of a tiny Llama's config.json: enough for the Hugging Face importer to reach the index.
HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 300,
             "max_position_embeddings": 64}


class Outside:
    """A folder beside the one under test, holding a sentinel file that crafted names point at.

    `names(folder)` are the ways a stored name can reach the sentinel from `folder`; `untouched()`
    asserts the sentinel kept its bytes and nothing new appeared in the folder.
    """

    def __init__(self, root: Path) -> None:
        self.dir = root / "outside"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret = self.dir / "secret"
        self.secret.write_text(SECRET)
        self.size, self.sha256 = len(SECRET), hashlib.sha256(SECRET.encode()).hexdigest()

    def names(self, folder: Path) -> dict[str, str]:
        up = os.path.relpath(self.secret, folder)
        return {"climbing": up, "absolute": str(self.secret), "climbing-inside": f"a/../{up}",
                "backslash": up.replace("/", "\\"), "nul": f"secret\0{up}", "empty": ""}

    def untouched(self) -> None:
        assert self.secret.read_text() == SECRET
        assert sorted(p.name for p in self.dir.iterdir()) == ["secret"]


def list_in_manifest(folder: Path, name: str, size: int, sha256: str) -> None:
    """Add `name` to a checkpoint manifest's files with the given size and sha256 (as a forger would)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][name] = {"size": size, "sha256": sha256}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def rewrite_metadata(folder: Path, change) -> None:
    """`change(metadata)` on the folder's `.metadata`, planted with its checksum in the manifest."""
    metadata = load_metadata((folder / METADATA).read_bytes(), "ours")
    change(metadata)
    plant(folder, METADATA, pickle.dumps(metadata))
