"""MFU arithmetic, the measured peak, and compile / activation checkpointing matching eager."""

import pytest

from core_harness import global_batches, run_core
from cs3ray.bench.peak import measure_peak
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


@pytest.mark.parametrize("flag", ["train.activation_checkpointing=true", "train.compile=true"])
def test_compile_and_activation_checkpointing_match_eager(flag):
    batches = global_batches(3, rows=4)
    eager = run_core(["precision=fp32"], 0, 1, batches)["losses"]
    other = run_core(["precision=fp32", flag], 0, 1, batches)["losses"]
    assert other == pytest.approx(eager, abs=1e-4)
