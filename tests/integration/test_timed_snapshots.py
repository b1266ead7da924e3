"""checkpoint.every_minutes on 2 workers: snapshots come by time as well as by steps, and every rank takes
each one at the same step (rank 0's vote rides on the step's loss all-reduce)."""

from __future__ import annotations

from cs3ray.ckpt import list_steps, step_dir
from cs3ray.config import load_config
from cs3ray.ops.events import read_events
from cs3ray.storage import open_url

from conftest import ROOT

STEPS = 16
# Every forward waits 20 ms (tests/helpers/slow_model.py), so the 0.12 s interval passes within 6 steps on any host.
SLOW = ["model.target=tests.helpers.slow_model:build", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
        "model.ffn_dim=128", "train.seq_len=32", "train.batch_size=4", "train.warmup_steps=0",
        "train.eval_every=1000", "train.eval_batches=1", "train.log_every=4", "data.max_bytes=100000",
        "precision=fp32", "parallel.strategy=ddp", "cluster.workers=2", "checkpoint.memory_tier=false"]


def test_time_triggered_snapshots_come_at_steps_every_rank_agrees_on(ray_client, tmp_path):
    from cs3ray.train import train

    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "configs/tiny.yaml", [*SLOW, f"run.dir={run_dir}", "run.name=timed",
                                                   f"train.steps={STEPS}", "checkpoint.every=1000",
                                                   "checkpoint.every_minutes=0.002", f"checkpoint.keep={STEPS}"])
    assert train(cfg, quiet=True)["steps"] == STEPS
    saves = [e for e in read_events(open_url(str(run_dir))) if e["event"] == "checkpoint"]
    # Before the last step (the last one's snapshot is taken anyway: its trigger may read either).
    timed = [e["step"] for e in saves if e["trigger"] == "minutes" and e["step"] < STEPS]
    assert len(timed) >= 2 and saves[-1]["step"] == STEPS and saves[-1]["trigger"] in ("minutes", "end"), saves
    # A snapshot is a collective: had a rank skipped a step rank 0 snapshotted (or taken another), the
    # save would have hung or left a folder without the manifest. Each one holds both ranks' own files.
    assert list_steps(open_url(str(run_dir))) == [e["step"] for e in saves]
    for step in timed:
        folder = run_dir / step_dir(step)
        assert {"rank-00000.pt", "rank-00001.pt", "manifest.json"} <= {p.name for p in folder.iterdir()}, step
