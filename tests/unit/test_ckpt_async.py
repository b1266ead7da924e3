"""Async checkpoints: staging reuses its host buffers, and the writer thread runs at low priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.ckpt.staging import Stager


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux behaviour")
def test_async_writer_thread_runs_at_lowest_priority_and_the_training_thread_does_not(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    seen = {}
    real_write = mgr._write

    def spy(*args):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return real_write(*args)

    mgr._write = spy
    state = _state(1)
    for step in (1, 2):
        mgr.save(step, state, {"step": step}, {"torch": torch.get_rng_state()}, {})
        saved = state["model"]["w"].clone()
        state["model"]["w"].add_(1.0)  # the next step changes the weights while the write goes on
    mgr.close()
    assert seen["nice"] == 19 and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
    fresh = _state(9)
    step, _, _ = CheckpointManager(str(tmp_path / "run")).load(fresh)
    assert step == 2 and torch.equal(fresh["model"]["w"], saved)
