"""The run's event log appends: on object storage a flush rewrites only its current small segment, so the
bytes written stay linear in the events; every reader gets each event once, in order, across resumes and
from runs written before segments."""

from __future__ import annotations

import json
import uuid

import pytest

from cs3ray.ops import events as event_log
from cs3ray.ops.events import EVENTS, EventLog, read_events, segment_indices
from cs3ray.ops.runs_overview import list_runs, load_run
from cs3ray.storage import Storage, open_url


class Clock:
    """A stand-in for the driver's monotonic clock: the test says when a second has passed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _event(seq: int) -> dict:
    # About the size of a real progress event.
    return {"event": "progress", "seq": seq, "step": seq, "loss": 2.0 + 1 / (seq + 1), "tokens_per_s": 12345.6,
            "lr": 3e-4, "mfu": 0.41, "workers": 64, "cache": {"l1_hits": seq, "l1_misses": 3, "l2_hits": 2}}


def _memory_run() -> Storage:
    return open_url(f"memory://event-log-{uuid.uuid4().hex[:8]}/runs/r")


@pytest.fixture()
def writes(monkeypatch) -> list[tuple[str, int]]:
    """(file, bytes) of every write through Storage (the object-store log's only way out)."""
    seen: list[tuple[str, int]] = []
    real = Storage.write_bytes

    def counting(self, data, *parts, **kwargs):
        seen.append(("/".join(parts), len(data)))
        return real(self, data, *parts, **kwargs)

    monkeypatch.setattr(Storage, "write_bytes", counting)
    return seen


def test_an_object_store_log_writes_bytes_linear_in_its_events(writes):
    run, clock = _memory_run(), Clock()
    log = EventLog(run, clock=clock)
    # 5,000 events over 1,000 flushes, each flush due (the policy's worst case: the clock moves a whole
    # REMOTE_FLUSH_S between polls); rewriting one whole log would write ~500x its final size here.
    for flush in range(1000):
        for i in range(5):
            log.add(_event(5 * flush + i))
        log.flush(force=False)
        clock.now += event_log.REMOTE_FLUSH_S
    log.flush()
    final = sum(len(run.read_bytes(event_log.segment_name(i))) for i in segment_indices(run))
    total = sum(n for _, n in writes)
    assert len(writes) == 1000 and total <= (event_log.SEGMENT_WRITES + 1) / 2 * final * 1.01, (total, final)
    assert len(segment_indices(run)) == 1000 // event_log.SEGMENT_WRITES  # one object per SEGMENT_WRITES flushes
    assert [e["seq"] for e in read_events(run)] == list(range(5000))


def test_polls_every_second_write_an_object_store_at_most_every_remote_flush_s(writes):
    run, clock = _memory_run(), Clock()
    log = EventLog(run, clock=clock)
    polls = 10 * int(event_log.REMOTE_FLUSH_S)
    for second in range(polls):
        log.add(_event(second))
        log.flush(force=False)
        clock.now += 1.0
    assert len(writes) == polls // event_log.REMOTE_FLUSH_S  # the first poll's event is written at once
    assert [e["seq"] for e in read_events(run)][0] == 0 and len(read_events(run)) < polls
    log.flush()  # the run's end: everything pending goes now
    assert [e["seq"] for e in read_events(run)] == list(range(polls))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_reader_gets_each_event_once_in_order_across_a_resume(where, tmp_path):
    run = open_url(str(tmp_path / "run")) if where == "local" else _memory_run()
    first = EventLog(run, clock=Clock())
    first.add({"event": "start", "seq": 0, "step": 0, "total_steps": 9})
    for seq in range(1, 4):
        first.add(_event(seq))
        first.flush(force=False)  # memory: the first write is due, the next two wait
    first.flush()
    resumed = EventLog(run, clock=Clock())  # a new driver, `--resume`
    resumed.add({"event": "start", "seq": 4, "step": 3, "total_steps": 9})
    for seq in range(5, 8):
        resumed.add(_event(seq))
    resumed.add({"event": "end", "seq": 8, "step": 9, "stopped": False})
    resumed.flush()
    assert [e["seq"] for e in read_events(run)] == list(range(9))
    record = load_run(run.url)  # what `cs3 report` reads
    assert [e["seq"] for e in record.events] == list(range(9)) and record.status == "finished"
    parent, name = run.url.rsplit("/", 1)
    [listed] = list_runs(parent)  # what `cs3 runs ls` reads: a run of segments alone is found too
    assert listed.name == name and [e["seq"] for e in listed.events] == list(range(9))
    if where == "local":
        assert segment_indices(run) == [] and len((tmp_path / "run" / EVENTS).read_text().splitlines()) == 9
    else:
        assert not run.exists(EVENTS) and segment_indices(run) == [0, 1]  # the resume started its own segment


def test_a_run_from_before_segments_keeps_its_log_and_a_resume_continues_it():
    run = _memory_run()
    old = [{"time": 1.8e9 + i, "event": "progress", "seq": i, "step": i} for i in range(3)]
    run.write_text("".join(json.dumps(e) + "\n" for e in old), EVENTS)  # the whole-file log of earlier versions
    assert [e["seq"] for e in read_events(run)] == [0, 1, 2]
    log = EventLog(run)
    log.add(_event(3))
    log.flush()
    assert [e["seq"] for e in read_events(run)] == [0, 1, 2, 3]
    assert json.loads(run.read_text(EVENTS).splitlines()[-1])["seq"] == 2  # never rewritten


def test_a_local_log_torn_by_a_killed_driver_loses_no_event_of_the_resume(tmp_path):
    run = open_url(str(tmp_path / "run"))
    run.makedirs()
    (tmp_path / "run" / EVENTS).write_text(json.dumps(_event(0)) + "\n" + '{"event": "progr')
    log = EventLog(run)
    log.add(_event(1))
    log.flush()
    assert [e["seq"] for e in read_events(run)] == [0, 1]
