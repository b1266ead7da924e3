"""A damaged or missing checkpoint is never used: the trainer's restore and every reader (open_checkpoint)
fall back memory -> primary -> replicas -> previous step, saying so in one warning line."""

import json
import logging

import pytest
import torch

from cs3ray.ckpt import CheckpointError, CheckpointManager, list_steps, load_for_inference, open_checkpoint, verify
from cs3ray.ckpt.export import consolidated_model
from cs3ray.ckpt.finetune import load_init_weights
from cs3ray.ckpt.locations import StorageLocation
from cs3ray.storage import open_url

from helpers.ckpt_runs import flip_byte, load, newest_only_chunk, same, save, small_model


def warnings(caplog) -> list[str]:
    """What cs3ray logged at WARNING or above (DCP logs its own caught exceptions to a NullHandler)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("cs3ray")]


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    model = small_model()
    save(mgr, model, 1)
    save(mgr, model, 2)
    meta = tmp_path / "run" / "step-00000002" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[-3] ^= 0x55
    meta.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        verify(open_url(str(tmp_path / "run" / "step-00000002")))
    state = {"model": small_model(1).state_dict()}
    step, _, _ = mgr.load(state)
    assert step == 1
    assert "step-00000002 refused" in caplog.text


@pytest.mark.parametrize("damage", ["truncate-chunk", "flip-chunk", "truncate-metadata", "flip-rank-file",
                                    "delete-chunk"])
def test_damaged_newest_falls_back_never_loads_bad_data(tmp_path, damage):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    old = small_model(1)
    save(mgr, old, 1)
    save(mgr, small_model(2), 2)
    chunk = newest_only_chunk(tmp_path / "run", 2, 1)
    target = {"truncate-chunk": chunk, "flip-chunk": chunk, "delete-chunk": chunk,
              "truncate-metadata": tmp_path / "run" / "step-00000002" / ".metadata",
              "flip-rank-file": tmp_path / "run" / "step-00000002" / "rank-00000.pt"}[damage]
    if damage.startswith("truncate"):
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage.startswith("flip"):
        flip_byte(target)
    else:
        target.unlink()
    got, fresh = load(mgr)
    assert got == 1 and same(fresh, old) and mgr.last_restore.source == "storage"


def test_replica_restores_when_primary_is_corrupt(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), keep=2, replicas=[str(tmp_path / "replica")])
    model = small_model()
    save(mgr, model, 5)
    assert list_steps(open_url(str(tmp_path / "replica"))) == [5]
    StorageLocation(open_url(str(tmp_path / "replica"))).check(5, deep=True)
    for chunk in (tmp_path / "run" / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"garbage")
    got, fresh = load(mgr)
    assert got == 5 and same(fresh, model)
    assert mgr.last_restore.source == "replica" and mgr.last_restore.url.endswith("replica")


def test_load_for_inference_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_for_inference(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_for_inference(str(tmp_path / "empty"))


def test_every_reader_falls_back_past_a_damaged_newest_checkpoint_with_one_warning_line(tmp_path, caplog):
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), keep=3)
    old = small_model(1)
    save(mgr, old, 1)
    save(mgr, small_model(2), 2)
    chunk = newest_only_chunk(run, 2, 1)
    flip_byte(chunk)  # same size: only reading it (its hash) can tell

    caplog.set_level(logging.WARNING)
    loaded = load_for_inference(str(run))  # generate, serve
    assert loaded.step == 1 and same(loaded.model, old) and loaded.url == str(run / "step-00000001")
    lines = warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"checkpoint {run / 'step-00000002'} refused (chunk ")
    assert chunk.name in lines[0] and "checksum" in lines[0] and lines[0].endswith(f"using {run / 'step-00000001'}")

    model, manifest = consolidated_model(str(run))  # ckpt export
    assert manifest["step"] == 1 and all(torch.equal(model[k], v) for k, v in old.state_dict().items())
    assert load_init_weights(small_model(3), str(run))["step"] == 1  # train.init_from
    ckpt = open_checkpoint(str(run), prepare=lambda c: {"model": small_model(4).state_dict()})
    assert (ckpt.step, ckpt.source, ckpt.manifest["step"]) == (1, "storage", 1)
    assert json.loads(ckpt.read("state.json"))["step"] == 1
    assert len(warnings(caplog)) == 4  # one line per open


def test_a_named_checkpoint_is_opened_or_refused_never_replaced_by_another(tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), keep=3)
    save(mgr, small_model(1), 1)
    save(mgr, small_model(2), 2)
    flip_byte(newest_only_chunk(run, 2, 1))
    with pytest.raises(CheckpointError, match=r"step-00000002'?: chunk .* does not match its checksum"):
        load_for_inference(str(run / "step-00000002"))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        open_checkpoint(str(run), step=2, prepare=lambda c: {"model": small_model(4).state_dict()})
    assert load_for_inference(str(run / "step-00000001")).step == 1
    with pytest.raises(CheckpointError, match="has no complete checkpoint of step 7"):
        open_checkpoint(str(run), step=7)


def test_readers_use_the_replicas_the_user_names_or_confirms(tmp_path, caplog):
    replica = tmp_path / "replica"
    mgr = CheckpointManager(str(tmp_path / "run"), replicas=[str(replica)])
    model = small_model()
    save(mgr, model, 5, [f'checkpoint.replicas=["{replica}"]'])
    for chunk in (tmp_path / "run" / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(b"garbage")
    # The replicas a stored config lists are not contacted unless the user confirms them.
    with pytest.raises(CheckpointError, match=r"lists 1 replica\(s\), not contacted .*--use-stored-replicas"):
        load_for_inference(str(tmp_path / "run"))
    loaded = load_for_inference(str(tmp_path / "run"), stored_replicas=True)
    assert loaded.step == 5 and same(loaded.model, model) and loaded.url == str(replica / "step-00000005")
    assert f"using {replica / 'step-00000005'}" in caplog.text
    loaded = load_for_inference(str(tmp_path / "run"), replicas=[str(replica)])  # named by the user
    assert loaded.url == str(replica / "step-00000005") and same(loaded.model, model)
    model_state, manifest = consolidated_model(str(tmp_path / "run"), replicas=[str(replica)])  # ckpt export
    assert manifest["step"] == 5 and all(torch.equal(model_state[k], v) for k, v in model.state_dict().items())
    assert load_init_weights(small_model(3), str(tmp_path / "run"), stored_replicas=True)["step"] == 5
