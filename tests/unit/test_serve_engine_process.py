"""The engine in its own process: the same tokens as in-process, cancel, queue limit, swap, and a
dead child that fails its requests instead of hanging them. Real child processes, no Ray."""

from __future__ import annotations

import threading
import time

import pytest
from test_serve_engine import EOS, GREEDY, model, prompts, run, text

from cs3ray.models.generate import SamplingParams
from cs3ray.serve.engine import Engine, EngineOptions, QueueFull
from cs3ray.serve.engine_process import EngineProcess
from cs3ray.serve.sequence import Event, GenRequest


class Collector:
    """Events of one request, with a way to wait for its end."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event) -> None:
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()


def submit(engine: EngineProcess, ids: list[int], params: SamplingParams = GREEDY) -> Collector:
    c = Collector()
    # ignore_eos: a random model may pick EOS early on another CPU; these tests need full lengths.
    engine.submit(GenRequest(ids, params, ignore_eos=True, emit=c))
    return c


@pytest.fixture(scope="module")
def engine():
    e = EngineProcess(model(), EOS, EngineOptions(max_batch=4, max_waiting=2, threads=1))
    yield e
    e.stop()


def test_same_text_as_in_process_and_load_counters(engine):
    ps = prompts(6)  # more than max_batch: some queue in the child, then join the batch
    expected = [text(evs) for evs in run(Engine(model(), EOS, EngineOptions(max_batch=4)),
                                         [GenRequest(p, GREEDY, ignore_eos=True) for p in ps])]
    got = [submit(engine, p) for p in ps[:4]]
    with pytest.raises(QueueFull, match="already waiting"):  # 4 running + 2 waiting is the limit
        for p in ps[4:] + ps[:1]:
            got.append(submit(engine, p))
    assert len(got) == 6
    for c in got:
        assert c.done.wait(60)
        assert c.events[-1].finish_reason == "length" and c.events[-1].completion_tokens == GREEDY.max_tokens
    assert [text(c.events) for c in got] == expected
    load = engine.load()
    assert load["running"] == load["waiting"] == 0 and load["steps"] >= GREEDY.max_tokens and load["cpu_s"] > 0


def test_cancel_ends_the_stream_and_frees_the_slot(engine):
    c = submit(engine, prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=250))
    deadline = time.time() + 30
    while not c.events and time.time() < deadline:
        time.sleep(0.01)
    engine.cancel(GenRequest([], GREEDY))  # a request it never saw is ignored
    engine.cancel(engine_request(engine, c))
    assert c.done.wait(30) and c.events[-1].finish_reason == "cancelled"
    assert c.events[-1].completion_tokens < 250 and engine.load()["running"] == 0


def engine_request(engine: EngineProcess, c: Collector) -> GenRequest:
    return next(r for r in engine._requests.values() if r.emit is c)


def test_swap_model_takes_new_weights_and_rejects_another_shape(engine):
    before = submit(engine, prompts(1)[0])
    assert before.done.wait(60)
    other = model()
    for p in other.parameters():
        p.data.mul_(-1.0)
    engine.swap_model(other)
    after = submit(engine, prompts(1)[0])
    assert after.done.wait(60) and text(after.events) != text(before.events)
    from cs3ray.models import PRESETS, Transformer

    with pytest.raises(ValueError, match="different model shape"):
        engine.swap_model(Transformer(PRESETS["small"]))


def test_a_dead_engine_process_fails_its_requests():
    e = EngineProcess(model(), EOS, EngineOptions(max_batch=2, threads=1))
    c = submit(e, prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=250))
    deadline = time.time() + 30
    while not c.events and time.time() < deadline:
        time.sleep(0.01)
    e._proc.kill()
    assert c.done.wait(30)
    assert c.events[-1].finish_reason == "error" and "engine process stopped" in c.events[-1].error
    assert not e.alive()
    with pytest.raises(QueueFull, match="has stopped"):
        submit(e, prompts(1)[0])
