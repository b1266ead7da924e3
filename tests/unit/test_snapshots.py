"""Which steps end in a snapshot: checkpoint.every steps or checkpoint.every_minutes, whichever comes first."""

from __future__ import annotations

from cs3ray.train.snapshots import END, MINUTES, PREEMPTION, STEPS, STOP, SnapshotClock, trigger


def test_the_clock_is_due_every_minutes_after_the_last_snapshot_of_any_trigger():
    now = [0.0]
    clock = SnapshotClock(0.5, clock=lambda: now[0])
    now[0] = 29.9
    assert not clock.due()
    now[0] = 30.0
    assert clock.due()
    clock.taken()  # a snapshot (a step-triggered one too) starts the next 30 s
    now[0] = 59.0
    assert not clock.due()
    now[0] = 1e9
    assert not SnapshotClock(None, clock=lambda: now[0]).due()  # unset: steps only


def test_whichever_comes_first_triggers_and_the_schedule_is_named_first():
    args = {"every": 100, "last_step": 1000}
    assert trigger(37, **args, timed=False, stop=False, preempted=False) is None
    assert trigger(37, **args, timed=True, stop=False, preempted=False) == MINUTES
    assert trigger(200, **args, timed=True, stop=False, preempted=False) == STEPS
    assert trigger(37, **args, timed=False, stop=False, preempted=True) == PREEMPTION
    assert trigger(37, **args, timed=False, stop=True, preempted=False) == STOP
    assert trigger(1000, every=300, last_step=1000, timed=False, stop=False, preempted=False) == END
