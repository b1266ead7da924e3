"""Saving and loading without a process group: layout, manifest, keep and GC, incremental chunks, crash safety,
durability, older formats."""

import io
import json

import pytest
import torch

from cs3ray.ckpt import CheckpointError, CheckpointManager, list_steps, load_for_inference, read_manifest
from cs3ray.ckpt.chunks import ChunkStore
from cs3ray.ckpt.locations import StorageLocation
from cs3ray.storage import open_url

from helpers.ckpt_runs import load, same, save, small_model


def test_save_load_keep_and_layout(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2)
    model = small_model()
    for step in (10, 20, 30):
        save(mgr, model, step)
    assert mgr.steps() == [20, 30] and mgr.latest() == 30
    folder = tmp_path / "run" / "step-00000030"
    names = {p.name for p in folder.iterdir()}
    assert {"manifest.json", "state.json", "config.yaml", "tokenizer.json", "rank-00000.pt", ".metadata"} <= names
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["world_size"] == 1 and manifest["format_version"] == 2
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert manifest["chunks"] and all(len(h) == 32 for h in manifest["chunks"])  # XXH3-128 names

    fresh = small_model(seed=1)
    state = {"model": fresh.state_dict()}
    step, meta, rank_state = mgr.load(state)
    fresh.load_state_dict(state["model"])
    assert step == 30 and meta["tokens_seen"] == 300 and "torch" in rank_state
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_format_1_checkpoint_with_sha256_chunk_names_still_loads_and_is_checked(tmp_path, monkeypatch):
    import hashlib

    import cs3ray.ckpt.chunks as chunks
    import cs3ray.ckpt.manifest as manifest

    model = small_model()
    with monkeypatch.context() as m:  # what cs3ray wrote before chunks were named by XXH3-128
        m.setattr(chunks, "digest", lambda blob: hashlib.sha256(memoryview(blob)).hexdigest())
        m.setattr(manifest, "FORMAT_VERSION", 1)
        save(CheckpointManager(str(tmp_path / "run")), model, 5)
    written = json.loads((tmp_path / "run" / "step-00000005" / "manifest.json").read_text())
    assert written["format_version"] == 1 and all(len(h) == 64 for h in written["chunks"])
    fresh = small_model(seed=1)
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
    save(mgr, small_model(), 5)
    (tmp_path / "run" / "step-00000009").mkdir()  # a save that crashed before its manifest
    (tmp_path / "run" / "step-00000009" / "__0_0.distcp").write_bytes(b"partial")
    assert list_steps(open_url(str(tmp_path / "run"))) == [5]
    assert load_for_inference(str(tmp_path / "run")).step == 5


def test_rank_state_loads_with_weights_only(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    save(mgr, small_model(), 3)
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
    save(CheckpointManager(str(tmp_path / "run")), small_model(), 1)
    assert len(events) == 2 and events[0] == "sync" and "manifest.json" in events[1], events
    assert os.path.isdir(tmp_path / "run" / "chunks")


def test_storage_sync_reaches_the_filesystem_and_is_a_no_op_for_object_stores(tmp_path):
    local = open_url(str(tmp_path / "not-yet" / "created"))
    local.write_bytes(b"x" * 10, "a", durable=False)
    local.sync()  # a real syncfs of tmp_path's filesystem
    open_url(str(tmp_path / "gone")).sync()  # nothing below it yet: its nearest existing folder is synced
    open_url("memory://cs3-sync-test").sync()
    assert (tmp_path / "not-yet" / "created" / "a").read_bytes() == b"x" * 10


def test_incremental_references_unchanged_chunks_and_gc_keeps_referenced(tmp_path, monkeypatch):
    listings = []
    real_sizes = ChunkStore.sizes
    monkeypatch.setattr(ChunkStore, "sizes", lambda self: listings.append(1) or real_sizes(self))
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2)
    model = small_model()
    save(mgr, model, 1)
    first = read_manifest(open_url(str(tmp_path / "run" / "step-00000001")))
    with torch.no_grad():
        model.output.weight.add_(1.0)  # one tensor changes
    save(mgr, model, 2)
    second = read_manifest(open_url(str(tmp_path / "run" / "step-00000002")))
    changed = model.output.weight.numel() * 4
    assert second["bytes_written"] == changed < 0.5 * second["bytes_total"]
    assert first["bytes_written"] == first["bytes_total"]
    with torch.no_grad():
        model.tok_emb.weight.mul_(2.0)
    save(mgr, model, 3)  # step 1 is pruned: its chunks that 2 and 3 do not use must go, the rest stay
    assert mgr.steps() == [2, 3]
    assert len(listings) == 1  # only the first save lists every chunk; later ones diff the manifests
    run = StorageLocation(open_url(str(tmp_path / "run")))
    stored = set(ChunkStore(run.run).sizes())
    live = {h for s in (2, 3) for h in read_manifest(run.folder(s))["chunks"]}
    assert stored == live
    for s in (2, 3):
        run.check(s, deep=True)
    got, fresh = load(mgr, 2)
    assert got == 2 and not same(fresh, model)
    got, fresh = load(mgr)
    assert got == 3 and same(fresh, model)


def test_crash_during_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=1)
    good = small_model(1)
    save(mgr, good, 1)
    calls = {"n": 0}
    real_put = ChunkStore.put

    def dying_put(self, h, blob):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("disk died")  # the process 'crashes' part-way through the tensor data
        real_put(self, h, blob)

    monkeypatch.setattr(ChunkStore, "put", dying_put)
    with pytest.raises(CheckpointError, match="disk died"):
        save(mgr, small_model(2), 2)
    monkeypatch.setattr(ChunkStore, "put", real_put)
    assert list_steps(open_url(str(tmp_path / "run"))) == [1]
    got, fresh = load(mgr)
    assert got == 1 and same(fresh, good)
    later = small_model(3)
    save(mgr, later, 3)  # the next save clears the partial folder and its orphan chunks
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["chunks", "step-00000003"]
    run = StorageLocation(open_url(str(tmp_path / "run")))
    assert set(ChunkStore(run.run).sizes()) == set(read_manifest(run.folder(3))["chunks"])
    assert same(load(mgr)[1], later)


def test_a_keeper_process_does_not_import_torch():
    # Keeper actors start on every node of every cluster: the module their process imports must stay light.
    import subprocess
    import sys

    from cs3ray.ckpt.keeper import Keeper  # the class the memory tier starts its actors from

    code = f"import sys, {Keeper.__module__}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
