"""`cs3 train parallel.pp=2` end to end on the session's Ray head: two workers, one pipeline stage each."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cs3ray.config import load_config
from cs3ray.data.shards import read_manifest
from cs3ray.data.stream import GlobalOrder
from cs3ray.models import train_flops_per_token

from conftest import ROOT, run_cs3

STEPS, BATCH, SEQ = 6, 8, 32
ARGS = ["precision=fp32", "model.dim=64", "model.n_layers=3", "model.n_heads=4", "model.ffn_dim=128",
        f"train.seq_len={SEQ}", f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.warmup_steps=0",
        "train.log_every=2", f"train.eval_every={STEPS}", f"checkpoint.every={STEPS}", "cache.trace=true",
        "parallel.pp=2", "parallel.pp_microbatches=4", "parallel.pp_schedule=gpipe"]


@pytest.mark.slow
def test_pipeline_run_trains_on_the_global_order_and_reports_its_stages(ray_head, tmp_path):
    from cs3ray.train.driver import prepare_data

    run_dir = tmp_path / "pp"
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", *ARGS, "--address", ray_head.address,
                    "--json"], env=ray_head.env(), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS and summary["pp"] == 2 and summary["pp_schedule"] == "gpipe"
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    assert 0 <= summary["bubble_fraction"] < 1 and 0 < summary["mfu"] <= 1
    # Where each stage's time went: computing, in sends and receives, the rest; shares of its step time.
    shares = summary["stage_time_shares"]
    assert len(shares) == 2 and all(set(s) == {"compute", "p2p", "other"} for s in shares)
    assert all(0 < s["compute"] < 1 and 0 < s["p2p"] < 1 and sum(s.values()) == pytest.approx(1, abs=2e-3) for s in shares)
    assert 1 - shares[0]["compute"] == pytest.approx(summary["bubble_fraction"], abs=0.05)  # the first stage's idle share
    # One data-parallel group of 2 stages: BATCH samples a step, exactly the start of the global order.
    assert summary["tokens_seen"] == STEPS * BATCH * SEQ
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={run_dir}", *ARGS])
    # Each stage's FLOPs: 2 blocks + 1 block and the output projection, adding up to the model's.
    assert sum(start["stage_flops_per_token"]) == pytest.approx(train_flops_per_token(cfg.model.args(), SEQ))
    assert start["stage_flops_per_token"][0] > 0 and start["stage_flops_per_token"][1] > 0
    # Each stage owns only its parameters.
    memory = summary["memory"]
    assert len(memory) == 2 and all(m["param_bytes"] > 0 for m in memory)
    traced = sorted((run_dir / "data-trace").iterdir())
    assert len(traced) == STEPS  # one writer per data-parallel group, not one per stage
    seen = np.concatenate([np.load(io.BytesIO(f.read_bytes())) for f in traced]).tolist()
    shards, _ = prepare_data(cfg)
    order = GlobalOrder(read_manifest(shards)["splits"]["train"], cfg.train.seed, cfg.cache.shuffle_window)
    assert seen == order.ids(0, STEPS * BATCH).tolist()
