"""Storage retries: transient errors retried with backoff up to a deadline, permanent ones never.

The failures come from a real fsspec filesystem (fsspec's in-memory one, registered under
`flaky://`) that raises the errors a remote store raises, on the calls the test chooses.
"""

from __future__ import annotations

import errno
import threading

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from cs3ray.ckpt import CheckpointError, CheckpointManager
from cs3ray.ckpt.chunks import ChunkStore
from cs3ray.config import build_config
from cs3ray.storage import StorageError, open_url


class FlakyFS(MemoryFileSystem):
    """memory:// that fails the next `plan` calls (each an exception, or a number of seconds to hang)."""

    protocol = "flaky"
    plan: list = []
    calls: list[tuple[str, str]] = []
    hangs_ended = 0  # hung calls that have returned
    release = threading.Event()  # set: every hang ends at once

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(str(path).replace("flaky://", "memory://", 1))

    def _io(self, op, path):
        type(self).calls.append((op, path))
        if self.plan:
            fault = self.plan.pop(0)
            if isinstance(fault, (int, float)):
                self.release.wait(fault)  # a request that hangs
                type(self).hangs_ended += 1
            elif fault is not None:
                raise fault

    def cat_file(self, path, *args, **kwargs):
        self._io("read", path)
        return super().cat_file(path, *args, **kwargs)

    def pipe_file(self, path, *args, **kwargs):
        self._io("write", path)
        return super().pipe_file(path, *args, **kwargs)

    def ls(self, path, *args, **kwargs):
        self._io("ls", path)
        return super().ls(path, *args, **kwargs)


fsspec.register_implementation("flaky", FlakyFS, clobber=True)


@pytest.fixture
def flaky(request):
    FlakyFS.plan, FlakyFS.calls, FlakyFS.hangs_ended, FlakyFS.release = [], [], 0, threading.Event()
    yield f"flaky://{request.node.name}"
    FlakyFS.plan = []
    FlakyFS.release.set()  # calls the test left hanging end now
    mem = MemoryFileSystem()
    if mem.exists(f"/{request.node.name}"):
        mem.rm(f"/{request.node.name}", recursive=True)


def test_transient_errors_are_retried_until_the_call_succeeds(flaky, caplog):
    st = open_url(flaky)
    FlakyFS.plan = [ConnectionResetError(errno.ECONNRESET, "connection reset by peer"),
                    OSError(errno.EBUSY, "Service Unavailable (503)")]
    st.write_bytes(b"payload", "a.bin")
    FlakyFS.plan = [TimeoutError("read timed out"), 0.0]
    assert st.read_bytes("a.bin") == b"payload"
    assert [op for op, _ in FlakyFS.calls] == ["write"] * 3 + ["read"] * 2
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("fault, words", [
    (FileNotFoundError(errno.ENOENT, "no such key"), "does not exist"),
    (PermissionError(errno.EACCES, "access denied"), "no permission"),
    (OSError(errno.ENOSPC, "no space left on device"), "no space left"),
])
def test_permanent_errors_fail_at_once(flaky, retry_clock, fault, words):
    st = open_url(flaky)
    FlakyFS.plan = [fault, None, None]
    with pytest.raises(StorageError, match=words):
        st.read_bytes("a.bin")
    assert len(FlakyFS.calls) == 1 and retry_clock.waits == []  # one attempt, no backoff before the error


def test_retries_back_off_until_the_deadline_then_give_up_in_one_clear_sentence(flaky, retry_clock):
    st = open_url(flaky, retry_deadline_s=0.6)
    st.write_bytes(b"x", "a.bin")
    FlakyFS.plan, FlakyFS.calls = [ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")] * 100, []
    with pytest.raises(StorageError) as info:
        st.read_bytes("a.bin")
    msg, waits = str(info.value), retry_clock.waits
    # After each failed attempt a backoff that doubles (0.1 s, 0.2 s...; jittered to half to all of it),
    # the last one cut to end at the deadline; no attempt after it.
    assert len(FlakyFS.calls) == len(waits) >= 3 and sum(waits) == pytest.approx(0.6)
    assert all(0.05 * 2**i <= w <= 0.1 * 2**i for i, w in enumerate(waits[:-1])), waits
    assert 0 < waits[-1] <= 0.1 * 2 ** (len(waits) - 1), waits
    assert msg.startswith(f"could not read '{flaky}/a.bin' within 0.6s ({len(waits)} attempts; ")
    assert "connection refused" in msg
    assert msg.count(". ") == 0 and msg.endswith("reachable.")


def test_a_hung_call_cannot_outlive_the_deadline(flaky):
    st = open_url(flaky, retry_deadline_s=0.6)
    st.write_bytes(b"x", "a.bin")
    FlakyFS.plan = [30.0] * 100  # every call hangs
    with pytest.raises(StorageError, match="no answer within"):
        st.read_bytes("a.bin")
    assert FlakyFS.hangs_ended == 0  # the error came at the deadline, with the request still hanging


def test_the_checkpoint_section_sets_the_retry_deadline(flaky, retry_clock):
    cfg = build_config({"checkpoint": {"retry_deadline_s": 0.6}})
    mgr = CheckpointManager.from_config(flaky, cfg)
    assert mgr.run.retry_deadline_s == 0.6
    FlakyFS.plan = [ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")] * 100
    with pytest.raises(StorageError, match="within 0.6s"):
        mgr.run.read_bytes("missing.bin")
    assert sum(retry_clock.waits) == pytest.approx(0.6)  # retried for the section's 0.6 s, not the default 60 s


def _state(seed):
    torch.manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)}}


def test_checkpoint_save_and_restore_ride_out_transient_storage_errors(flaky, caplog):
    mgr = CheckpointManager(flaky, keep=2)
    # Every third storage call fails once: chunk uploads, small files, listings and reads all retry.
    FlakyFS.plan = [None, None, ConnectionResetError(errno.ECONNRESET, "reset")] * 60
    state = _state(1)
    mgr.save(1, state, {"step": 1}, {"torch": torch.get_rng_state()}, {"config.yaml": "a: 1\n"})
    fresh = _state(2)
    step, meta, _ = CheckpointManager(flaky).load(fresh)
    assert (step, meta["step"]) == (1, 1)
    assert all(torch.equal(fresh["model"][k], state["model"][k]) for k in state["model"])
    retried = {r.getMessage().split()[1] for r in caplog.records if "retrying" in r.getMessage()}
    assert {"write", "read", "list"} <= retried  # failures really hit the save and the restore


def test_a_bad_checksum_is_not_retried(flaky):
    mgr = CheckpointManager(flaky, keep=2)
    mgr.save(1, _state(1), {"step": 1}, {"torch": torch.get_rng_state()}, {})
    store = ChunkStore(open_url(flaky))
    h = next(iter(store.sizes()))
    path = store.root.path(*store.name(h))
    blob = bytearray(MemoryFileSystem().cat_file(path))
    blob[0] ^= 1
    MemoryFileSystem().pipe_file(path, bytes(blob))
    FlakyFS.calls = []
    with pytest.raises(CheckpointError, match="checksum"):
        store.get(h)
    assert FlakyFS.calls == [("read", path)]
