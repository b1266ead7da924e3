"""MFU: the arithmetic, and the rate a run reports (which windows count)."""

import pytest

from cs3ray.core.mfu import mfu, model_flops_per_step
from cs3ray.models import ModelArgs, train_flops_per_token


def test_mfu_by_hand():
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, ffn_dim=16, vocab_size=264, max_seq_len=16)
    fpt = train_flops_per_token(args, seq_len=4)  # 16704, counted by hand in test_model.py
    assert model_flops_per_step(fpt, 1000) == 16704 * 1000
    # 2 workers at 1e9 FLOP/s peak each; 100 tokens/s -> 1.6704e6 FLOP/s used -> 0.0008352
    assert mfu(100, fpt, 2, 1e9) == pytest.approx(16704 * 100 / 2e9)
    assert mfu(100, fpt, 2, 0) == 0.0


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
