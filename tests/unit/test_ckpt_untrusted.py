"""Loading a checkpoint never runs code from it: crafted pickles are refused, model.target needs --trust-code."""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from cs3ray.ckpt import CheckpointError, CheckpointManager, load_for_inference
from cs3ray.ckpt.chunks import METADATA, ChunkStore, digest
from cs3ray.ckpt.dcp_metadata import load_metadata
from cs3ray.ckpt.export import consolidated_model
from cs3ray.ckpt.manifest import write_manifest
from cs3ray.config import load_config, to_yaml
from cs3ray.errors import UserError
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.serve.deploy import make_spec
from cs3ray.storage import open_url

from helpers.serve_checkpoints import make_checkpoint
from helpers.strategy_checkpoints import STRATEGIES, save_and_load_every_strategy
from helpers.untrusted import OpenForWrite, Touch, crafted_metadata, plant, write_target_module

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
