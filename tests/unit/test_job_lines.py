"""Following a job: its JSON event lines read like `cs3 train`, split chunks make whole lines, and a stream that
drops and starts over from the log's beginning prints each character once (Ray's client faked: the dropped
stream itself is tests/integration/test_job_follow.py's)."""

from __future__ import annotations

import json

import pytest

from cs3ray.ops import job_follow
from cs3ray.ops.cluster import ClusterError
from cs3ray.ops.jobs import Dashboard
from cs3ray_cli.job_lines import Renderer, event_line


def test_events_render_as_cs3_train_prints_them_and_other_lines_pass():
    assert event_line({"event": "progress", "step": 7, "loss": 2.34567, "tokens_per_s": 12345.6, "workers": 2}) == \
        "step 7: loss 2.346, 12,346 tokens/s, 2 workers"
    assert event_line({"event": "eval", "step": 10, "val_loss": 1.5}) == "step 10: validation loss 1.5000"
    assert event_line({"event": "worker", "rank": 1}) is None
    written: list[str] = []
    render = Renderer(written.append)
    text = json.dumps({"event": "restored", "step": 20}) + "\nplain line\n{not json\n" + '{"event": "eval", "st'
    render(text[:13])
    render(text[13:])
    render('ep": 3, "val_loss": 2.0}')
    render.close()
    assert written == ["resumed from step 20\n", "plain line\n", "{not json\n", "step 3: validation loss 2.0000\n"]
    raw: list[str] = []
    Renderer(raw.append, raw=True)(text)
    assert "".join(raw) == text


class FakeJobs:
    """Ray's job client as the follower uses it: each stream replays the log from its start."""

    def __init__(self, log: str, streams: list[tuple[int, bool]], final: str = "SUCCEEDED") -> None:
        self.log, self.streams, self.final = log, streams, final  # (characters a stream sends, then fails?)

    async def tail_job_logs(self, job_id):
        upto, fails = self.streams.pop(0)
        for i in range(0, upto, 5):
            yield self.log[i:min(i + 5, upto)]
        if fails:
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    def get_job_status(self, job_id):
        return type("S", (), {"value": self.final if not self.streams else "RUNNING"})()

    def get_job_logs(self, job_id):
        return self.log


def test_a_stream_that_drops_twice_prints_each_character_once(monkeypatch):
    log = "".join(f"line {i}\n" for i in range(40))
    fake = FakeJobs(log, [(37, True), (12, True), (200, False), (len(log) - 3, False)])
    monkeypatch.setattr(job_follow, "client", lambda dashboard: fake)
    out, notes = [], []
    status = job_follow.follow(Dashboard("http://127.0.0.1:1", "test"), "job", out.append, notes.append,
                               sleep=lambda s: None)
    assert status == "SUCCEEDED" and "".join(out) == log  # the stored log gives what the last stream missed
    assert any("dropped" in n for n in notes) and any("reconnected" in n for n in notes)


def test_a_job_api_that_stays_away_is_one_error_naming_the_job(monkeypatch):
    def away(dashboard):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(job_follow, "client", away)
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(job_follow.time, "monotonic", lambda: next(clock))
    with pytest.raises(ClusterError, match="did not answer for 300 s.*job j1 may still be running"):
        job_follow.follow(Dashboard("http://127.0.0.1:1", "test"), "j1", print, sleep=lambda s: None)
