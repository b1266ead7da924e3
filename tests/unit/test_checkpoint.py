"""Checkpoint manager without a process group: layout, manifest, checksums, fallback, keep."""

import io
import json

import pytest
import torch

from cs3ray.ckpt import CheckpointError, CheckpointManager, list_steps, load_for_inference, verify
from cs3ray.config import load_config, to_yaml
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.storage import open_url


def _save(mgr, model, step):
    files = {"config.yaml": to_yaml(load_config(None, ["model.preset=tiny"])), "tokenizer.json": ByteTokenizer().to_json()}
    return mgr.save(step, {"model": model.state_dict()}, {"step": step, "tokens_seen": step * 10},
                    {"torch": torch.get_rng_state()}, files)


def test_save_load_keep_and_layout(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2)
    model = Transformer(load_config(None).model.args())
    for step in (10, 20, 30):
        _save(mgr, model, step)
    assert mgr.steps() == [20, 30] and mgr.latest() == 30
    folder = tmp_path / "run" / "step-00000030"
    names = {p.name for p in folder.iterdir()}
    assert {"manifest.json", "state.json", "config.yaml", "tokenizer.json", "rank-00000.pt", ".metadata"} <= names
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["world_size"] == 1 and manifest["format_version"] == 2
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert manifest["chunks"] and all(len(h) == 32 for h in manifest["chunks"])  # XXH3-128 names

    fresh = Transformer(load_config(None).model.args())
    state = {"model": fresh.state_dict()}
    step, meta, rank_state = mgr.load(state)
    fresh.load_state_dict(state["model"])
    assert step == 30 and meta["tokens_seen"] == 300 and "torch" in rank_state
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_a_format_1_checkpoint_with_sha256_chunk_names_still_loads_and_is_checked(tmp_path, monkeypatch):
    import hashlib

    import cs3ray.ckpt.chunks as chunks
    import cs3ray.ckpt.manifest as manifest

    model = Transformer(load_config(None).model.args())
    with monkeypatch.context() as m:  # what cs3ray wrote before chunks were named by XXH3-128
        m.setattr(chunks, "digest", lambda blob: hashlib.sha256(memoryview(blob)).hexdigest())
        m.setattr(manifest, "FORMAT_VERSION", 1)
        _save(CheckpointManager(str(tmp_path / "run")), model, 5)
    written = json.loads((tmp_path / "run" / "step-00000005" / "manifest.json").read_text())
    assert written["format_version"] == 1 and all(len(h) == 64 for h in written["chunks"])
    fresh = Transformer(load_config(None).model.args())
    state = {"model": fresh.state_dict()}
    assert CheckpointManager(str(tmp_path / "run")).load(state)[0] == 5
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    h = max(written["chunks"], key=written["chunks"].get)
    path = tmp_path / "run" / "chunks" / h[:2] / h
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        CheckpointManager(str(tmp_path / "run")).load(state)  # its sha256 still guards it


def test_folder_without_manifest_is_not_a_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    model = Transformer(load_config(None).model.args())
    _save(mgr, model, 5)
    (tmp_path / "run" / "step-00000009").mkdir()  # a save that crashed before its manifest
    (tmp_path / "run" / "step-00000009" / "__0_0.distcp").write_bytes(b"partial")
    assert list_steps(open_url(str(tmp_path / "run"))) == [5]
    assert load_for_inference(str(tmp_path / "run")).step == 5


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    model = Transformer(load_config(None).model.args())
    _save(mgr, model, 1)
    _save(mgr, model, 2)
    meta = tmp_path / "run" / "step-00000002" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-3] ^= 0x55
    meta.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        verify(open_url(str(tmp_path / "run" / "step-00000002")))
    state = {"model": Transformer(load_config(None).model.args()).state_dict()}
    step, _, _ = mgr.load(state)
    assert step == 1
    assert "skipping checkpoint" in caplog.text


def test_load_for_inference_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_for_inference(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_for_inference(str(tmp_path / "empty"))


def test_rank_state_loads_with_weights_only(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    _save(mgr, Transformer(load_config(None).model.args()), 3)
    raw = (tmp_path / "run" / "step-00000003" / "rank-00000.pt").read_bytes()
    assert "torch" in torch.load(io.BytesIO(raw), weights_only=True)


def test_a_save_fsyncs_only_its_manifest_after_one_sync_of_everything_else(tmp_path, monkeypatch):
    """Hundreds of chunk files cost one filesystem sync, and the manifest is only written after it."""
    import os

    import cs3ray.storage as storage

    events: list[str] = []
    real_sync, real_fsync = storage.sync_filesystem, os.fsync
    monkeypatch.setattr(storage, "sync_filesystem", lambda path: (events.append("sync"), real_sync(path))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    _save(CheckpointManager(str(tmp_path / "run")), Transformer(load_config(None).model.args()), 1)
    assert len(events) == 2 and events[0] == "sync" and "manifest.json" in events[1], events
    assert os.path.isdir(tmp_path / "run" / "chunks")


def test_storage_sync_reaches_the_filesystem_and_is_a_no_op_for_object_stores(tmp_path):
    local = open_url(str(tmp_path / "not-yet" / "created"))
    local.write_bytes(b"x" * 10, "a", durable=False)
    local.sync()  # a real syncfs of tmp_path's filesystem
    open_url(str(tmp_path / "gone")).sync()  # nothing below it yet: its nearest existing folder is synced
    open_url("memory://cs3-sync-test").sync()
    assert (tmp_path / "not-yet" / "created" / "a").read_bytes() == b"x" * 10
