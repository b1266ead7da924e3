"""MFU arithmetic, the measured peak, and compile / activation checkpointing matching eager."""

import pytest

from helpers.core import global_batches, run_core
from cs3ray.bench.peak import measure_peak
from cs3ray.bench.train import steps_for_budget
from cs3ray.core.precision import native_bf16, resolve_precision
from cs3ray.core.mfu import mfu, model_flops_per_step
from cs3ray.models import ModelArgs, train_flops_per_token


def test_mfu_by_hand():
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, ffn_dim=16, vocab_size=264, max_seq_len=16)
    fpt = train_flops_per_token(args, seq_len=4)  # 16704, counted by hand in test_model.py
    assert model_flops_per_step(fpt, 1000) == 16704 * 1000
    # 2 workers at 1e9 FLOP/s peak each; 100 tokens/s -> 1.6704e6 FLOP/s used -> 0.0008352
    assert mfu(100, fpt, 2, 1e9) == pytest.approx(16704 * 100 / 2e9)
    assert mfu(100, fpt, 2, 0) == 0.0


def test_peak_is_measured_and_positive():
    import torch

    assert measure_peak(torch.float32, 1, size=256, seconds=0.1) > 1e8


def test_a_slow_dtype_keeps_the_peak_measurement_near_its_budget():
    # fp16 products are emulated on most CPUs (and slow on all): a worker training in fp16 measures
    # its peak with one warm-up and single timed products, not seven products whatever they cost.
    import time

    import torch

    a = torch.randn(512, 512).half()
    a @ a
    t0 = time.perf_counter()
    a @ a
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert measure_peak(torch.float16, 1, size=512, seconds=one / 4) > 0
    assert time.perf_counter() - t0 < 5 * one


def test_auto_precision_is_bf16_only_on_bf16_hardware():
    assert resolve_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32")
    assert resolve_precision("fp16", "cpu") == "fp16"  # a named precision is kept as asked


def test_bench_steps_fit_the_budget():
    assert steps_for_budget(1.5, 420, 5) == (3, 15)  # fast steps: the full run
    warmup, steps = steps_for_budget(30, 420, 5)  # 30 s steps: the fewest that still measure
    assert (warmup, steps) == (1, 2)
    warmup, steps = steps_for_budget(6, 420, 5)
    assert 5 * (warmup + steps) * 6 <= 420 + 5 * 6


@pytest.mark.parametrize("flag", ["train.activation_checkpointing=true", "train.compile=true"])
def test_compile_and_activation_checkpointing_match_eager(flag):
    batches = global_batches(3, rows=4)
    eager = run_core(["precision=fp32"], 0, 1, batches)["losses"]
    other = run_core(["precision=fp32", flag], 0, 1, batches)["losses"]
    assert other == pytest.approx(eager, abs=1e-4)


def test_the_run_rate_leaves_out_the_first_window_and_the_memory_tracked_step(tmp_path):
    from cs3ray.config import load_config
    from cs3ray.storage import open_url
    from cs3ray.train.driver import summarize

    def window(tps, mfu_, tracked=False):
        return {"event": "progress", "tokens_per_s": tps, "mfu": mfu_, "loss": 1.0, "memory_tracked": tracked}
    events = [window(10, 0.1), window(50, 0.2, tracked=True), window(100, 0.4), window(120, 0.6)]
    s = summarize(load_config(None), open_url(str(tmp_path)), events, 1.0)
    assert s["tokens_per_s"] == 110 and s["mfu"] == 0.5
    # With nothing else left, the tracked window still counts rather than no rate at all.
    assert summarize(load_config(None), open_url(str(tmp_path)), events[:2], 1.0)["tokens_per_s"] == 50
