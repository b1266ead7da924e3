"""Incremental chunks, GC, integrity fallbacks, crash safety, replicas, async, export, CLI (no Ray)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from cs3ray.ckpt import CheckpointError, CheckpointManager, list_steps, read_manifest
from cs3ray.ckpt.chunks import ChunkStore
from cs3ray.ckpt.locations import StorageLocation
from cs3ray.config import load_config, to_yaml
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.storage import open_url

ARGS = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64", "model.max_seq_len=32",
        "train.seq_len=16"]


def _model(seed=0):
    torch.manual_seed(seed)
    return Transformer(load_config(None, ARGS).model.args())


def _save(mgr, model, step):
    files = {"config.yaml": to_yaml(load_config(None, ARGS)), "tokenizer.json": ByteTokenizer().to_json()}
    return mgr.save(step, {"model": model.state_dict()}, {"step": step, "tokens_seen": step},
                    {"torch": torch.get_rng_state()}, files)


def _load(mgr, step=None):
    fresh = _model(seed=99)
    state = {"model": fresh.state_dict()}
    got, meta, _ = mgr.load(state, step)
    fresh.load_state_dict(state["model"])
    return got, fresh


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_incremental_references_unchanged_chunks_and_gc_keeps_referenced(tmp_path, monkeypatch):
    listings = []
    real_sizes = ChunkStore.sizes
    monkeypatch.setattr(ChunkStore, "sizes", lambda self: listings.append(1) or real_sizes(self))
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2)
    model = _model()
    _save(mgr, model, 1)
    first = read_manifest(open_url(str(tmp_path / "run" / "step-00000001")))
    with torch.no_grad():
        model.output.weight.add_(1.0)  # one tensor changes
    _save(mgr, model, 2)
    second = read_manifest(open_url(str(tmp_path / "run" / "step-00000002")))
    changed = model.output.weight.numel() * 4
    assert second["bytes_written"] == changed < 0.5 * second["bytes_total"]
    assert first["bytes_written"] == first["bytes_total"]
    with torch.no_grad():
        model.tok_emb.weight.mul_(2.0)
    _save(mgr, model, 3)  # step 1 is pruned: its chunks that 2 and 3 do not use must go, the rest stay
    assert mgr.steps() == [2, 3]
    assert len(listings) == 1  # only the first save lists every chunk; later ones diff the manifests
    run = StorageLocation(open_url(str(tmp_path / "run")))
    stored = set(ChunkStore(run.run).sizes())
    live = {h for s in (2, 3) for h in read_manifest(run.folder(s))["chunks"]}
    assert stored == live
    for s in (2, 3):
        run.check(s, deep=True)
    got, fresh = _load(mgr, 2)
    assert got == 2 and not _same(fresh, model)
    got, fresh = _load(mgr)
    assert got == 3 and _same(fresh, model)


@pytest.mark.parametrize("damage", ["truncate-chunk", "flip-chunk", "truncate-metadata", "flip-rank-file",
                                    "delete-chunk"])
def test_damaged_newest_falls_back_never_loads_bad_data(tmp_path, damage):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    old = _model(1)
    _save(mgr, old, 1)
    new = _model(2)
    _save(mgr, new, 2)
    run = StorageLocation(open_url(str(tmp_path / "run")))
    m2 = read_manifest(run.folder(2))
    only_new = sorted(set(m2["chunks"]) - set(read_manifest(run.folder(1))["chunks"]), key=lambda h: -m2["chunks"][h])
    chunk = tmp_path / "run" / "chunks" / only_new[0][:2] / only_new[0]
    target = {"truncate-chunk": chunk, "flip-chunk": chunk, "delete-chunk": chunk,
              "truncate-metadata": tmp_path / "run" / "step-00000002" / ".metadata",
              "flip-rank-file": tmp_path / "run" / "step-00000002" / "rank-00000.pt"}[damage]
    raw = bytearray(target.read_bytes())
    if damage.startswith("truncate"):
        target.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage.startswith("flip"):
        raw[len(raw) // 2] ^= 0x01
        target.write_bytes(bytes(raw))
    else:
        target.unlink()
    got, fresh = _load(mgr)
    assert got == 1 and _same(fresh, old) and mgr.last_restore.source == "storage"


def test_crash_during_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=1)
    good = _model(1)
    _save(mgr, good, 1)
    calls = {"n": 0}
    real_put = ChunkStore.put

    def dying_put(self, h, blob):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("disk died")  # the process 'crashes' part-way through the tensor data
        real_put(self, h, blob)

    monkeypatch.setattr(ChunkStore, "put", dying_put)
    with pytest.raises(CheckpointError, match="disk died"):
        _save(mgr, _model(2), 2)
    monkeypatch.setattr(ChunkStore, "put", real_put)
    assert list_steps(open_url(str(tmp_path / "run"))) == [1]
    got, fresh = _load(mgr)
    assert got == 1 and _same(fresh, good)
    later = _model(3)
    _save(mgr, later, 3)  # the next save clears the partial folder and its orphan chunks
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["chunks", "step-00000003"]
    run = StorageLocation(open_url(str(tmp_path / "run")))
    assert set(ChunkStore(run.run).sizes()) == set(read_manifest(run.folder(3))["chunks"])
    assert _same(_load(mgr)[1], later)


def test_replica_restores_when_primary_is_corrupt(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2, replicas=[str(tmp_path / "replica")])
    model = _model()
    _save(mgr, model, 5)
    assert list_steps(open_url(str(tmp_path / "replica"))) == [5]
    StorageLocation(open_url(str(tmp_path / "replica"))).check(5, deep=True)
    for chunk in (tmp_path / "run" / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"garbage")
    got, fresh = _load(mgr)
    assert got == 5 and _same(fresh, model)
    assert mgr.last_restore.source == "replica" and mgr.last_restore.url.endswith("replica")


def test_async_save_stages_a_copy_and_training_goes_on(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _save(mgr, model, 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the optimizer may change weights once staging is done
    mgr.close()
    got, fresh = _load(CheckpointManager(str(tmp_path / "run")))
    assert got == 7
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_export_and_cli(tmp_path):
    from safetensors.torch import load_file

    from cs3ray_cli.main import app

    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    model = _model()
    _save(mgr, model, 3)
    _save(mgr, model, 4)
    runner = CliRunner()
    res = runner.invoke(app, ["ckpt", "ls", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    assert [c["step"] for c in json.loads(res.stdout.strip().splitlines()[-1])["checkpoints"]] == [3, 4]
    res = runner.invoke(app, ["ckpt", "verify", f"{tmp_path / 'run'}/4"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "m.safetensors"
    res = runner.invoke(app, ["ckpt", "export", str(tmp_path / "run"), "--format", "safetensors", "--out", str(out)])
    assert res.exit_code == 0, res.output
    tensors = load_file(str(out))
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
    res = runner.invoke(app, ["ckpt", "export", f"{tmp_path / 'run'}/3", "--format", "torch", "--out",
                              str(tmp_path / "m.pt")])
    assert res.exit_code == 0, res.output
    plain = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(plain) == set(model.state_dict())
    meta = tmp_path / "run" / "step-00000004" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-5])
    res = runner.invoke(app, ["ckpt", "verify", str(tmp_path / "run")])
    assert res.exit_code == 2 and "checksum" in res.output
    res = runner.invoke(app, ["ckpt", "export", str(tmp_path / "run"), "--format", "onnx"])
    assert res.exit_code == 2


def test_a_keeper_process_does_not_import_torch():
    # Keeper actors start on every node of every cluster: importing their module must stay light.
    import subprocess
    import sys

    code = "import sys, cs3ray.ckpt.keeper; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
