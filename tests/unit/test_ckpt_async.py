"""Async checkpoints: staging reuses its host buffers; the writer runs at low priority until waited for."""

from __future__ import annotations

import os
import sys
import threading
import time

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
def test_writer_thread_runs_at_lowest_priority_until_training_waits_for_it(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), async_mode="async")
    seen: list[int] = []
    real_write = mgr._write

    def spy(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(0.5)  # the test's thread calls wait() meanwhile
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_write(*args)

    mgr._write = spy
    state = _state(1)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for step in (1, 2):
        mgr.save(step, state, {"step": step}, {"torch": torch.get_rng_state()}, {})
        saved = state["model"]["w"].clone()
        state["model"]["w"].add_(1.0)  # the next step changes the weights while the write goes on
        time.sleep(0.1) if step == 1 else None
    mgr.close()
    if os.geteuid() == 0:  # elsewhere the writer keeps the caller's priority (it could not get it back)
        assert seen[0] == 19 and seen[1] == mine  # low while training runs, lifted while save(2) waits
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    fresh = _state(9)
    step, _, _ = CheckpointManager(str(tmp_path / "run")).load(fresh)
    assert step == 2 and torch.equal(fresh["model"]["w"], saved)
