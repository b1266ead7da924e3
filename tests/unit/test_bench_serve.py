"""`cs3 bench serve`'s pieces that decide what it measures: the served model writes text, the workload is
seeded, replays pool into one cell."""

from __future__ import annotations

import torch

from cs3ray.bench.serve import MODES, REPLAY_ORDER, TEXT_STEPS, _writes_text
from cs3ray.bench.serve_load import Replay, Result, summarize, workload
from cs3ray.models import PRESETS, ByteTokenizer, Transformer
from cs3ray.models.generate import SamplingParams
from cs3ray.serve.engine import Engine
from cs3ray.serve.sequence import GenRequest


def _silent_share(model: Transformer) -> float:
    """Share of sampled tokens (as the benchmark samples them) that stream no text."""
    engine, events = Engine(model, ByteTokenizer().eos_id), []
    for i in range(8):
        engine.submit(GenRequest(list(b"def main("), SamplingParams(temperature=0.8, max_tokens=64, seed=i),
                                 ignore_eos=True, emit=events.append))
    while not engine.idle():
        engine.step()
    return 1 - sum(1 for e in events if e.text) / (8 * 64)


def test_a_few_steps_make_the_benchmark_model_write_text():
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    assert _silent_share(model) > 0.1  # random weights: partial UTF-8 and special tokens stream nothing
    assert _silent_share(_writes_text(model.train(), TEXT_STEPS["tiny"])) < 0.02


def test_workload_is_seeded_and_fits_the_context():
    a, b = workload(50, rate=20.0, seed=3), workload(50, rate=20.0, seed=3)
    assert a == b and a != workload(50, rate=20.0, seed=4)
    assert all(len(it.prompt.encode()) + 1 + it.max_tokens <= 256 for it in a)
    assert [it.at for it in a] == sorted(it.at for it in a)


def test_replays_pool_into_one_cell():
    fast = Replay([Result(ok=True, ttft=0.01, gaps=[0.02, 0.02], tokens=30)], seconds=1.0)
    slow = Replay([Result(ok=True, ttft=0.03, gaps=[0.04], tokens=30), Result(error="HTTP 503: busy")], seconds=2.0)
    cell = summarize([fast, slow])
    assert cell["tokens_per_s"] == 20.0  # all tokens over all time, not the mean of 30 and 15
    assert cell["replay_tokens_per_s"] == [30.0, 15.0]
    assert (cell["requests"], cell["errors"], cell["first_error"]) == (3, 1, "HTTP 503: busy")
    assert cell["max_itl_ms"] == 40.0 and cell["p99_ttft_ms"] == 30.0  # percentiles over both replays
    assert REPLAY_ORDER.count("continuous") == 2 and set(REPLAY_ORDER) == set(MODES)
