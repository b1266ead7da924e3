"""Why the worker group restarted: the `restart` event the run's monitor puts before a restarted group's start."""

from __future__ import annotations

from cs3ray.storage import StorageError
from cs3ray.train.restarts import DIED, RestartExplainer, failure_event


def start(workers: int, step: int) -> dict:
    return {"event": "start", "workers": workers, "step": step, "wall": 1.0}


def test_each_restart_names_its_cause():
    why = RestartExplainer()
    assert why.before(start(2, 0)) is None  # the first start is no restart
    assert why.before({"event": "progress", "step": 3}) is None
    error = StorageError("could not write 'step-00000030/rank-00001.pt' within 8s (5 attempts): connection refused")
    assert why.before(failure_event(1, 30, error)) is None
    assert why.before(failure_event(0, 30, RuntimeError("a later, secondary error"))) is None
    restart = why.before(start(2, 20))
    assert restart == {"event": "restart", "wall": 1.0, "attempt": 1, "step": 20,
                       "cause": "worker 1 failed at step 30: StorageError: could not write 'step-00000030/rank-00001.pt' "
                                "within 8s (5 attempts): connection refused"}
    assert why.before(start(2, 20))["cause"] == DIED  # nothing reported: SIGKILL, the OOM killer, a lost node
    assert why.before(start(1, 20))["cause"] == "the worker group was resized from 2 to 1 workers"
    gloo = RuntimeError("[/__w/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:12472. This is typically caused by a remote worker crashing.")
    why.before(failure_event(0, 8, gloo))
    assert why.before(start(2, 4))["cause"] == f"{DIED}; worker 0 then lost its connection to it at step 8"
    why.before(failure_event(0, 8, gloo))
    why.before(failure_event(1, 8, MemoryError("cannot allocate")))  # the peer's own error, reported later
    assert why.before(start(2, 4))["cause"] == "worker 1 failed at step 8: MemoryError: cannot allocate"
    assert why.before(failure_event(0, None, KeyboardInterrupt())) is None
    assert why.before(start(1, 20))["cause"] == "worker 0 failed: KeyboardInterrupt"
