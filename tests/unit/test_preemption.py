"""Preemption notices: which drains concern the run, the SIGTERM handler, the wait for Ray Train's teardown,
and the restart cause they give."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from cs3ray.train import preemption
from cs3ray.train.preemption import (
    SIGTERM_RECEIVED,
    DrainWatcher,
    Preempted,
    drain_notice,
    install_sigterm_handler,
    wait_for_teardown,
)
from cs3ray.train.restarts import RestartExplainer, failure_event


def test_only_drains_of_the_groups_nodes_are_a_notice_with_the_earliest_deadline():
    nodes = {"aa" * 14, "bb" * 14}
    assert drain_notice({"cc" * 14: 5_000}, nodes, now=1.0) is None  # a node the run has no worker on
    notice = drain_notice({"bb" * 14: 30_000, "aa" * 14: 20_000, "cc" * 14: 1_000}, nodes, now=1.0)
    assert notice == {"event": "preemption", "wall": 1.0, "notice": "drain", "nodes": ["aa" * 14, "bb" * 14],
                      "deadline": 20.0}
    assert drain_notice({"aa" * 14: 0}, nodes, now=1.0)["deadline"] is None  # a drain without a deadline


def test_the_watcher_reads_the_drains_on_its_own_thread_and_survives_a_failed_read():
    seen: list[dict] = []
    got = threading.Event()
    reads = iter([RuntimeError("GCS unavailable"), {"aa": 7}])

    def read() -> dict:
        item = next(reads, {})
        if isinstance(item, Exception):
            raise item
        return item

    def on_drains(drains: dict) -> None:
        if drains:
            seen.append(drains)
            got.set()

    watcher = DrainWatcher(on_drains, poll_s=0.01, read=read)
    try:
        assert got.wait(10)
    finally:
        watcher.stop()
    assert seen[0] == {"aa": 7}


def test_sigterm_asks_for_the_snapshot_and_a_second_one_goes_to_the_previous_handler():
    previous_calls: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: previous_calls.append(signum))
    try:
        install_sigterm_handler()
        install_sigterm_handler()  # a second group in the same process keeps the original previous handler
        assert not SIGTERM_RECEIVED.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert SIGTERM_RECEIVED.wait(5) and previous_calls == []  # the training loop snapshots and ends the group
        os.kill(os.getpid(), signal.SIGTERM)
        assert previous_calls == [signal.SIGTERM]  # the grace period is over: exit as before
    finally:
        signal.signal(signal.SIGTERM, original)
        SIGTERM_RECEIVED.clear()
        preemption._previous = None


def test_after_the_snapshot_a_rank_waits_for_the_teardown_and_ends_the_attempt_itself_only_past_the_deadline():
    now = [100.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    with pytest.raises(Preempted, match="snapshot of step 7"):
        wait_for_teardown(120.0, detected=100.0, step=7, clock=lambda: now[0], sleep=sleep, grace_s=5)
    assert now[0] == pytest.approx(125.0) and max(slept) <= 1.0
    now[0] = 100.0
    with pytest.raises(Preempted):  # no deadline: Ray Train's own fallback after the notice, then the grace
        wait_for_teardown(None, detected=100.0, step=7, clock=lambda: now[0], sleep=sleep, grace_s=5)
    assert now[0] == pytest.approx(100.0 + preemption.NO_DEADLINE_S + 5)


def test_a_preemption_names_the_restart_before_the_error_that_ended_the_group():
    why = RestartExplainer()
    why.before({"event": "start", "workers": 2, "step": 0, "wall": 1.0})
    why.before({"event": "preemption", "wall": 10.0, "notice": "drain", "nodes": ["f00d" * 7], "deadline": 30.0})
    why.before(failure_event(1, 12, Preempted("the node was drained")))
    restart = why.before({"event": "start", "workers": 2, "step": 12, "wall": 40.0})
    assert restart["cause"] == f"preemption: node {('f00d' * 7)[:12]} drained with 20 s left to its deadline"
    why.before({"event": "preemption", "wall": 50.0, "notice": "sigterm", "rank": 1, "step": 15})
    assert why.before({"event": "start", "workers": 2, "step": 15})["cause"] == (
        "preemption: worker 1 received SIGTERM at step 15")
    assert why.before({"event": "start", "workers": 2, "step": 15})["cause"].startswith("a worker process died")


def test_cs3_train_prints_the_notice_as_it_comes(capsys):
    from cs3ray_cli.train_cmd import TrainProgress

    with TrainProgress(10, enabled=True) as progress:
        progress({"event": "preemption", "wall": 10.0, "notice": "drain", "nodes": ["ab" * 14], "deadline": 30.0})
    assert (f"preemption: node {('ab' * 14)[:12]} drained with 20 s left to its deadline: taking a snapshot of the "
            "current step") in " ".join(capsys.readouterr().err.split())
