"""Resume exactness end to end: train with 2 workers, stop, resume with 1; the samples seen are one pass."""

from __future__ import annotations

import collections
import io
import os
from pathlib import Path

import numpy as np

if (Path.home() / ".ray" / "auth_token").exists():  # before Ray is imported (see test_serve.py)
    os.environ.setdefault("RAY_AUTH_MODE", "token")

from cs3ray.config import load_config  # noqa: E402
from cs3ray.data.shards import read_manifest  # noqa: E402
from cs3ray.data.stream import GlobalOrder  # noqa: E402
from cs3ray.storage import open_url  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _traced(run_dir: Path) -> list[int]:
    ids: list[int] = []
    for f in sorted((run_dir / "data-trace").iterdir()):
        ids += np.load(io.BytesIO(f.read_bytes())).tolist()
    return ids


def test_two_workers_then_one_see_exactly_one_pass(ray_head, tmp_path):
    from cs3ray.train import train

    for k, v in ray_head.env().items():
        if k.startswith("RAY_") and k != "RAY_ADDRESS":
            os.environ.setdefault(k, v)
    base = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'shards'}", "data.max_bytes=400000",
            "data.samples_per_shard=256", "train.batch_size=4", "train.seq_len=32", "train.eval_every=1000",
            "train.eval_batches=1", "train.log_every=1", "train.warmup_steps=0", "checkpoint.every=1000",
            f"cache.disk_dir={tmp_path / 'l2'}", "cache.trace=true", "cache.shuffle_window=2"]
    first = load_config(ROOT / "configs/tiny.yaml", base + ["train.steps=3", "cluster.workers=2"])
    s1 = train(first, address=ray_head.address, quiet=True)
    assert s1["steps"] == 3
    second = load_config(ROOT / "configs/tiny.yaml", base + ["train.steps=7", "cluster.workers=1"])
    s2 = train(second, resume=True, address=ray_head.address, quiet=True)
    assert s2["steps"] == 7
    seen = _traced(tmp_path / "run")
    consumed = (3 * 2 + 4 * 1) * 4  # steps x workers x batch (grad_accum 1)
    assert len(seen) == consumed
    shards = open_url(str(next((tmp_path / "shards").iterdir())))
    order = GlobalOrder(read_manifest(shards)["splits"]["train"], first.train.seed, 2)
    assert collections.Counter(seen) == collections.Counter(order.ids(0, consumed).tolist())
    assert len(set(seen)) == consumed  # within one epoch: nothing repeated
