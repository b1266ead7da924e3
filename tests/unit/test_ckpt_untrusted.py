"""Loading a checkpoint never runs code from it (crafted pickles are refused, model.target needs --trust-code), and
never reads outside it (stored names that are paths are refused, declared sizes are checked against the bytes)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from cs3ray.ckpt import CheckpointError, CheckpointManager, load_for_inference
from cs3ray.ckpt.catalog import verify_checkpoints
from cs3ray.ckpt.chunks import METADATA, ChunkStore, digest
from cs3ray.ckpt.dcp_metadata import load_metadata
from cs3ray.ckpt.export import consolidated_model
from cs3ray.ckpt.manifest import MANIFEST, read_manifest, write_manifest
from cs3ray.config import load_config, to_yaml
from cs3ray.errors import UserError
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.serve.deploy import make_spec
from cs3ray.storage import open_url

from helpers.serve_checkpoints import make_checkpoint
from helpers.strategy_checkpoints import STRATEGIES, save_and_load_every_strategy
from helpers.untrusted import (
    OpenForWrite,
    Outside,
    Touch,
    crafted_metadata,
    list_in_manifest,
    plant,
    rewrite_metadata,
    write_target_module,
)

ROOT = Path(__file__).resolve().parents[2]


def fresh_state() -> dict:
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    return {"model": Transformer(cfg.model.args()).state_dict(), "optim": {}}


def plain_checkpoint(run: Path) -> Path:
    """A format-1 checkpoint (plain DCP files, no chunks), as older cs3ray wrote them."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.dir={run}"])
    folder = run / "step-00000001"
    dcp.save({"model": Transformer(cfg.model.args()).state_dict()}, storage_writer=FileSystemWriter(str(folder)))
    (folder / "config.yaml").write_text(to_yaml(cfg))
    (folder / "tokenizer.json").write_text(ByteTokenizer().to_json())
    write_manifest(open_url(str(folder)), 1, 1, {})
    return folder


def test_real_metadata_of_every_strategy_loads_through_the_restricted_readers(tmp_path):
    # Each rank saves (chunks and plain DCP) and loads back through the manager's and the plain reader.
    save_and_load_every_strategy(str(tmp_path))
    for name in STRATEGIES:
        model, _ = consolidated_model(str(tmp_path / name))  # export's own read of `.metadata`
        assert model
        assert load_for_inference(str(tmp_path / name)).step == 1


@pytest.mark.parametrize("payload", [Touch, OpenForWrite])
def test_crafted_metadata_is_refused_by_every_reader_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "payload-ran"
    folder = Path(make_checkpoint(tmp_path / "run"))
    plant(folder, METADATA, crafted_metadata(folder, payload(marker)))
    refused = r"\.metadata' refers to .* which DCP metadata never holds; refusing to load it"
    for load in (lambda: load_for_inference(str(folder)),                          # generate / serve
                 lambda: consolidated_model(str(folder)),                          # ckpt export
                 lambda: CheckpointManager(str(tmp_path / "run")).load(fresh_state())):  # --resume, init_from
        with pytest.raises(CheckpointError, match=refused):
            load()
    assert not marker.exists()


def test_crafted_metadata_of_a_plain_dcp_folder_is_refused(tmp_path):
    # DCP's own FileSystemReader unpickles `.metadata` with pickle.load: ours replaces that read.
    folder = plain_checkpoint(tmp_path / "run")
    assert load_for_inference(str(folder)).step == 1
    marker = tmp_path / "payload-ran"
    plant(folder, METADATA, crafted_metadata(folder, Touch(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata' refers to pathlib\.Path\.touch"):
        load_for_inference(str(folder))
    assert not marker.exists()


def test_a_non_tensor_entry_that_would_run_code_is_refused(tmp_path):
    # Metadata of allowed classes only, declaring a model weight a pickled object: DCP's planner
    # would torch.load it with weights_only=False.
    marker = tmp_path / "payload-ran"
    folder = Path(make_checkpoint(tmp_path / "run"))
    metadata = load_metadata((folder / METADATA).read_bytes(), "ours")
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    buf = io.BytesIO()
    torch.save(Touch(marker), buf)
    blob = buf.getvalue()
    ChunkStore(open_url(str(tmp_path / "run"))).put(digest(blob), blob)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = {"kind": "bytes", "chunk": digest(blob), "size": len(blob), "new": True}
    plant(folder, METADATA, pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=rf"entry '{key}' .* is not data that torch.load\(weights_only=True\)"):
        load_for_inference(str(folder))
    assert not marker.exists()


@pytest.fixture
def target_module(tmp_path, monkeypatch):
    """A model factory module in a tmp dir on sys.path; building a model touches a marker file."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield write_target_module(tmp_path)
    sys.modules.pop("mymodels", None)


@pytest.mark.parametrize("stored_trust", [False, True])
def test_a_checkpoints_model_target_is_imported_only_with_trust_code(tmp_path, target_module, stored_trust):
    target, marker = target_module
    folder = make_checkpoint(tmp_path / "run", overrides=[f"model.target={target}",
                                                          f"model.trust_code={str(stored_trust).lower()}"])
    message = rf"names model.target '{target}', code .* pass --trust-code"
    with pytest.raises(UserError, match=message) as info:
        load_for_inference(folder)  # a trust_code stored in the checkpoint is not the user's word
    assert "\n" not in str(info.value)  # the CLI's one line (exit 2)
    with pytest.raises(UserError, match=message):
        make_spec(folder)  # `cs3 serve` / jobs/serve.py: refused before any Ray
    assert not marker.exists() and "mymodels" not in sys.modules
    assert make_spec(folder, trust_code=True).trust_code
    assert load_for_inference(folder, trust_code=True).step == 1
    assert marker.exists()


# -- names from storage are names, never paths -------------------------------------------------------------------
NAMES = ["climbing", "absolute", "climbing-inside", "backslash", "nul", "empty"]


@pytest.mark.parametrize("kind", NAMES)
def test_a_manifest_naming_a_path_is_refused_before_anything_is_read(tmp_path, kind):
    # The forged entry carries the sentinel's real size and sha256: only the name check can stop it.
    outside = Outside(tmp_path)
    folder = Path(make_checkpoint(tmp_path / "run"))
    name = outside.names(folder)[kind]
    list_in_manifest(folder, name, outside.size, outside.sha256)
    refused = r"manifest.json' names the file .*; refusing to read it\.$"
    (result,) = verify_checkpoints(str(tmp_path / "run"))  # cs3 ckpt verify
    assert not result["ok"] and re.search(refused, result["error"]), result
    with pytest.raises(CheckpointError, match=refused):
        read_manifest(open_url(str(folder)))
    with pytest.raises(CheckpointError, match=r"manifest.json' names the file"):
        load_for_inference(str(folder))  # generate / serve
    outside.untouched()


def test_a_chunk_id_that_is_not_hex_is_refused(tmp_path):
    outside = Outside(tmp_path)
    folder = Path(make_checkpoint(tmp_path / "run"))
    store = ChunkStore(open_url(str(tmp_path / "run")))
    climb = os.path.relpath(outside.secret, Path(store.root.path()) / "xx")
    for bad in (climb, "0" * 31, "G" * 32, "A" * 32):  # a path, too short, not hex, upper case
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["chunks"] = {bad: outside.size}
        (folder / MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=r"manifest.json' names the chunk .*, which is not 32 or 64 hex"):
            load_for_inference(str(folder))
    with pytest.raises(CheckpointError, match="not 32 or 64 hex digits"):
        store.get(climb)
    outside.untouched()


def test_a_metadata_item_naming_a_path_is_refused(tmp_path):
    # Chunked `.metadata` names each item's chunk; a climbing one would be read from outside the chunk folder.
    outside = Outside(tmp_path)
    folder = Path(make_checkpoint(tmp_path / "run"))
    climb = os.path.relpath(outside.secret, Path(ChunkStore(open_url(str(tmp_path / "run"))).root.path()) / "xx")

    def climb_first(metadata):
        next(iter(metadata.storage_data.values()))["chunk"] = climb

    rewrite_metadata(folder, climb_first)
    for load in (lambda: load_for_inference(str(folder)), lambda: consolidated_model(str(folder))):
        with pytest.raises(CheckpointError, match=r"\.metadata' names the chunk .*, which is not 32 or 64 hex"):
            load()
    outside.untouched()


def test_a_plain_dcp_relative_path_that_climbs_is_refused(tmp_path):
    # DCP's FileSystemReader joins `relative_path` to the folder and reads it.
    outside = Outside(tmp_path)
    folder = plain_checkpoint(tmp_path / "run")
    climb = os.path.relpath(outside.secret, folder)

    def climb_all(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = climb

    rewrite_metadata(folder, climb_all)
    with pytest.raises(CheckpointError, match=r"\.metadata' names the file .*, which is a path"):
        load_for_inference(str(folder))
    outside.untouched()


def test_sizes_in_metadata_are_checked_against_the_stored_bytes(tmp_path):
    folder = Path(make_checkpoint(tmp_path / "run"))

    def bigger_item(metadata):  # a chunk's own description claims more elements than its bytes hold
        info = next(i for i in metadata.storage_data.values() if i["kind"] == "tensor" and i["shape"])
        info["shape"] = [info["shape"][0] * 1000, *info["shape"][1:]]

    rewrite_metadata(folder, bigger_item)
    with pytest.raises(CheckpointError, match=r"tensor of shape .* but it holds \d+ bytes"):
        load_for_inference(str(folder))

    folder = Path(make_checkpoint(tmp_path / "run2"))

    def huge_tensor(metadata):  # export allocates every model tensor from its declared size: 4 TiB here
        md = next(m for k, m in metadata.state_dict_metadata.items() if k.startswith("model."))
        md.size = torch.Size([2**20, 2**20])

    rewrite_metadata(folder, huge_tensor)
    with pytest.raises(CheckpointError, match=r"declares tensor 'model\..*' of shape \(1048576, 1048576\) "
                                              r"\(4398046511104 bytes\), more than the \d+ bytes stored for it"):
        consolidated_model(str(folder))
