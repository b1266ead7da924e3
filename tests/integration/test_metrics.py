"""A run's metrics on Ray's Prometheus endpoint: the session head's `--metrics-export-port` text parses with
prometheus_client's parser and holds every cs3_train gauge while `cs3 train` runs against the head, restore
and compression figures included once a resumed run resizes to 2 workers with int8 gradients (fp32, then fp16)."""

from __future__ import annotations

import subprocess
import time

import pytest

from cs3ray.ops.metrics import TRAIN_GAUGES

from conftest import ROOT
from helpers.prometheus import scrape

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=3",
         "train.eval_batches=1", "checkpoint.every=3", "data.max_bytes=200000", "precision=fp32"]


def gauges(url: str, run: str) -> dict[str, float]:
    """The cs3_train gauges of `run` on the endpoint, by Prometheus name."""
    return {s.name: s.value for samples in scrape(url, "ray_cs3_train_").values() for s in samples
            if s.labels.get("run") == run}


def watch(cmd: list[str], env: dict, url: str, run: str, wanted: set[str]) -> dict[str, float]:
    """Run `cmd`, scraping every half second until it has ended and every wanted gauge was seen."""
    seen: dict[str, float] = {}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ended = time.time() + 300, None
        while time.time() < deadline:
            seen.update(gauges(url, run))
            if proc.poll() is not None:
                # A finished driver's gauges linger on the endpoint a while: long enough for its last push.
                ended = ended or time.time()
                if wanted <= seen.keys() or time.time() > ended + 20:
                    break
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    return seen


@pytest.mark.slow
def test_metrics_endpoint_holds_the_runs_gauges(ray_head, tmp_path):
    run_dir = tmp_path / "metered"
    base = ["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "run.name=metered", *SMALL,
            "--address", ray_head.address]
    names = {f"ray_cs3_train_{k}" for k in TRAIN_GAUGES}
    later = {"ray_cs3_train_checkpoint_restore_s", "ray_cs3_train_comm_bytes_per_step", "ray_cs3_train_wire_ratio"}

    first = watch([*base, "train.steps=3", "cluster.workers=1"], ray_head.env(), ray_head.metrics_url, "metered",
                  names - later)
    assert names - later <= first.keys(), sorted(names - later - first.keys())
    assert first["ray_cs3_train_step"] == 3 and first["ray_cs3_train_restarts"] == 0
    assert first["ray_cs3_train_grad_norm"] > 0 and first["ray_cs3_train_checkpoint_save_s"] > 0

    # Resumed on 2 workers with int8 gradients in fp16 (a checkpoint loads in any precision): a restore, bytes
    # on the wire and a loss scale.
    second = watch([*base, "--resume", "train.steps=6", "cluster.workers=2", "compression.codec=int8", "precision=fp16"],
                   ray_head.env(), ray_head.metrics_url, "metered", names)
    assert names <= second.keys(), sorted(names - second.keys())
    assert second["ray_cs3_train_step"] == 6 and second["ray_cs3_train_workers"] == 2
    assert second["ray_cs3_train_checkpoint_restore_s"] > 0
    assert 0 < second["ray_cs3_train_wire_ratio"] < 0.5 and second["ray_cs3_train_comm_bytes_per_step"] > 0
    assert second["ray_cs3_train_loss_scale"] > 1 and first["ray_cs3_train_loss_scale"] == 1
