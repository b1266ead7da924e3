"""Async checkpoints: staging reuses page-aligned host buffers; a save is the state when it was called;
large files are written with O_DIRECT (or the ordinary way where a filesystem refuses it)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from cs3ray import direct_io
from cs3ray.ckpt import CheckpointManager
from cs3ray.ckpt.staging import Stager
from cs3ray.storage import open_url

from helpers.ckpt_runs import load, save, small_model


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32)}}}, "lr": 0.1}


def test_staging_copies_into_the_same_buffers_every_save():
    stager, state = Stager(), _state(0)
    first = stager.stage(state)
    ptrs = [first["model"]["w"].data_ptr(), first["optim"]["state"]["w"]["exp_avg"].data_ptr()]
    assert first["lr"] == 0.1 and torch.equal(first["model"]["w"], state["model"]["w"])
    state["model"]["w"].add_(1.0)  # training goes on: the staged copy must not change
    assert not torch.equal(first["model"]["w"], state["model"]["w"])
    second = stager.stage(state)
    assert [second["model"]["w"].data_ptr(), second["optim"]["state"]["w"]["exp_avg"].data_ptr()] == ptrs
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    state["model"]["w"] = torch.randn(8, 8)  # a new shape gets a new buffer
    assert stager.stage(state)["model"]["w"].shape == (8, 8)


def test_async_save_is_the_state_at_save_time_while_training_goes_on(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    state = _state(1)
    state["model"]["big"] = torch.randn(700, 1024)  # over direct_io.MIN_BYTES: an O_DIRECT chunk
    for step in (1, 2):
        mgr.save(step, state, {"step": step}, {"torch": torch.get_rng_state()}, {})
        saved = {k: v.clone() for k, v in state["model"].items()}
        for v in state["model"].values():
            v.add_(1.0)  # the next step changes the weights while the write goes on
    mgr.close()
    fresh = _state(9)
    fresh["model"]["big"] = torch.zeros(700, 1024)
    step, _, _ = CheckpointManager(str(tmp_path / "run")).load(fresh)
    assert step == 2 and all(torch.equal(fresh["model"][k], v) for k, v in saved.items())


def test_async_save_stages_a_copy_and_training_goes_on(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    model = small_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save(mgr, model, 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the optimizer may change weights once staging is done
    mgr.close()
    got, fresh = load(CheckpointManager(str(tmp_path / "run")))
    assert got == 7
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("offset", [0, 1])  # an aligned buffer is written in place, any other through a bounce
@pytest.mark.parametrize("size", [direct_io.MIN_BYTES + 5, 3 * direct_io.ALIGN, 9 << 20])
def test_direct_write_keeps_every_byte_and_exact_size(tmp_path, size, offset):
    buf = direct_io.aligned_empty(size + offset)
    buf[:] = np.random.default_rng(size).integers(0, 256, size + offset, dtype=np.uint8)
    assert buf.ctypes.data % direct_io.ALIGN == 0
    data = buf[offset:]
    open_url(str(tmp_path)).write_bytes(data, "chunk")
    assert (tmp_path / "chunk").read_bytes() == data.tobytes()
    assert [p.name for p in tmp_path.iterdir()] == ["chunk"]  # no temp file left


def test_a_filesystem_without_o_direct_gets_an_ordinary_write(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    blob = np.arange(direct_io.MIN_BYTES * 2, dtype=np.uint8)
    assert not direct_io.write_direct(str(tmp_path / "x"), blob) and not (tmp_path / "x").exists()
    open_url(str(tmp_path)).write_bytes(blob, "y")
    assert (tmp_path / "y").read_bytes() == blob.tobytes()


def test_staging_buffers_are_page_aligned():
    staged = Stager().stage(_state(3))
    assert staged["model"]["w"].data_ptr() % direct_io.ALIGN == 0
    assert staged["optim"]["state"]["w"]["exp_avg"].data_ptr() % direct_io.ALIGN == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_staging_hashes_host_tensors_and_the_writer_reuses_those_hashes(tmp_path, monkeypatch, threads):
    import xxhash

    import cs3ray.ckpt.chunks as chunks
    from cs3ray.ckpt.chunks import blob_key, tensor_blob

    stager = Stager(threads=threads)
    state = _state(4)
    staged = stager.stage(state)
    for t in (staged["model"]["w"], staged["model"]["b"], staged["optim"]["state"]["w"]["exp_avg"]):
        blob = tensor_blob(t)
        assert stager.digests[blob_key(blob)] == xxhash.xxh3_128_hexdigest(blob.tobytes())
    stager.close()

    # In an async save the background writer hashes only what staging did not (the small pickled
    # non-tensor items): on a CPU host the tensors' hashes are computed while training waits anyway.
    hashed: list[int] = []
    real = chunks.digest
    monkeypatch.setattr(chunks, "digest", lambda blob: hashed.append(memoryview(blob).nbytes) or real(blob))
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    state["model"]["big"] = torch.randn(700, 1024)
    mgr.save(1, state, {"step": 1}, {"torch": torch.get_rng_state()}, {})
    mgr.close()
    assert hashed and max(hashed) < 64 * 32 * 4  # no tensor was hashed twice
    fresh = _state(9)
    fresh["model"]["big"] = torch.zeros(700, 1024)
    CheckpointManager(str(tmp_path / "run")).load(fresh)  # every chunk still matches its name
    assert torch.equal(fresh["model"]["big"], state["model"]["big"])


def test_staging_allocates_its_host_buffers_on_the_host_whatever_the_default_device():
    # The device check of cs3ray.ops.device_probe: a buffer cs3ray allocates without naming the host would
    # follow the default device (on a GPU rank: device memory, the second copy staging exists to avoid).
    from cs3ray.ops.device_probe import cs3ray_allocations_on

    state = {**_state(4), "empty": torch.zeros(0), "half": torch.randn(8, dtype=torch.bfloat16)}
    with cs3ray_allocations_on("meta"):
        staged = Stager().stage(state)
    for key in ("empty", "half"):
        assert staged[key].device.type == "cpu" and torch.equal(staged[key], state[key])
    assert torch.equal(staged["model"]["w"], state["model"]["w"])
    # A tensor on another device (meta stands in for a GPU here) gets a host buffer of its shape and dtype.
    stager = Stager()
    stager._buffers = [None]
    buf = stager._buffer(0, torch.empty(4, 3, dtype=torch.float16, device="meta"))
    assert buf.device.type == "cpu" and buf.shape == (4, 3) and buf.dtype == torch.float16
