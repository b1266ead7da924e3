"""`cs3 bench serve`'s pieces that decide what it measures: the served model writes text, the workload is
seeded, replays pool into one cell."""

from __future__ import annotations

import math

import torch

from cs3ray.bench import stats
from cs3ray.bench.serve import MODES, TARGETS, TEXT_STEPS, _round_order, _rounds, _summary, _writes_text, judged
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
    assert cell["replay_p99_itl_ms"] == [20.0, 40.0]  # and each replay's own p99 gap


def test_the_targets_cell_runs_interleaved_rounds_in_alternating_order():
    assert _rounds("tiny", 16, quick=False) >= 3 and _rounds("tiny", 16, quick=True) >= 2
    assert _rounds("tiny", 64, quick=False) == _rounds("small", 16, quick=False) == 1
    assert set(_round_order(0)) == set(MODES) and _round_order(1) == _round_order(0)[::-1]


def test_targets_are_the_medians_of_per_round_figures_with_intervals():
    def cell(tps: list[float], p99: list[float | None]) -> dict:
        return {"replay_tokens_per_s": tps, "replay_p99_itl_ms": p99}
    modes = {"continuous": {"16": cell([1000.0, 1200.0, 1100.0], [20.0, 30.0, None])},
             "unbatched": {"16": cell([200.0, 200.0, 250.0], [5.0] * 3)},
             "serve_batch": {"16": cell([500.0, 0.0, 550.0], [9.0] * 3)}}
    r = _summary(modes)
    assert r["speedup_vs_unbatched_at_16_rounds"] == [5.0, 6.0, 4.4] and r["speedup_vs_unbatched_at_16"] == 5.0
    # A round in which a peer delivered nothing has no ratio; a round without gaps has no p99.
    assert r["speedup_vs_serve_batch_at_16_rounds"] == [2.0, 2.0] and r["p99_itl_ms_at_16_rounds"] == [20.0, 30.0]
    low, high = r["p99_itl_ms_at_16_interval"]
    assert low < 25.0 < high  # a difference's interval (raw t), not a ratio's
    r |= judged(r)
    assert r["targets"] == TARGETS and set(r["verdicts"]) == set(TARGETS)
    assert r["verdicts"]["speedup_vs_unbatched_at_16"] == "inconclusive"
    assert r["verdicts"]["speedup_vs_serve_batch_at_16"] == "met"  # identical rounds: a zero-width interval
    assert "p99_itl_ms_at_16 25.00" in stats.verdict_line(r) and "(<= 50)" in stats.verdict_line(r)


def test_a_cell_nobody_measured_is_inconclusive():
    r = _summary({m: {} for m in MODES})
    assert r["speedup_vs_unbatched_at_16"] is None and math.isnan(r["speedup_vs_unbatched_at_16_interval"][0])
    assert set(judged(r)["verdicts"].values()) == {"inconclusive"}
