"""Resume across strategies, world sizes and loaders, end to end: fsdp x 2 workers (direct loader) -> ddp x 1
(Ray Data loader, with a data.transform) -> zero1 x 2 (Ray Data).

The loss continues where it stopped, and the samples trained on across the three runs are exactly
the start of the global order, each once (the data position survives every resharding). The first
run is the session's `trained_run` (`cs3 train`, tests/conftest.py), continued in a copy; the middle
run goes through the Python API (`cs3ray.train.train`), the last through `cs3 train`.
"""

import collections
import io
import json
import os
import shutil

import numpy as np
import pytest

from cs3ray.config import load_config
from cs3ray.data.shards import read_manifest
from cs3ray.data.stream import GlobalOrder

from conftest import ROOT, TRAINED_STEPS, run_cs3
from helpers.transforms import PIDS

BATCH = 8  # per worker, as in the first run: half of tiny.yaml's, for shorter steps
FAST = ["train.log_every=2", "train.eval_every=100", "train.eval_batches=2", "checkpoint.every=100",
        "train.warmup_steps=2", f"train.batch_size={BATCH}", "cache.trace=true", "precision=fp32"]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _traced(run_dir) -> list[int]:
    ids: list[int] = []
    for f in sorted((run_dir / "data-trace").iterdir()):
        ids += np.load(io.BytesIO(f.read_bytes())).tolist()
    return ids


@pytest.mark.slow
def test_fsdp_x2_then_ddp_x1_then_zero1_x2_continues_loss_and_data_order(ray_head, trained_run, tmp_path):
    from cs3ray.train import train
    from cs3ray.train.driver import prepare_data

    first_dir, first = trained_run  # TRAINED_STEPS steps of fsdp x 2 workers, BATCH samples each, traced
    run_dir = tmp_path / "reshard"
    shutil.copytree(first_dir, run_dir)  # the session's run stays as the other tests read it
    common = ["configs/tiny.yaml", f"run.dir={run_dir}", *FAST, "--address", ray_head.address, "--json"]
    before = [e for e in _events(run_dir) if e["event"] == "progress"][-1]["loss"]

    for k, v in ray_head.env().items():  # this process becomes a Ray client of the session's head
        if k.startswith("RAY_") and k != "RAY_ADDRESS":
            os.environ.setdefault(k, v)
    # The first run read through the direct loader, the next two through Ray Data: the order is one.
    ray_data = ["data.loader=ray_data", "data.transform=tests.helpers.transforms:record_pid"]
    shutil.rmtree(PIDS, ignore_errors=True)
    middle = load_config(ROOT / "configs/tiny.yaml", [f"run.dir={run_dir}", *FAST, f"train.steps={TRAINED_STEPS + 4}",
                                                      "parallel.strategy=ddp", "cluster.workers=1", *ray_data])
    assert train(middle, resume=True, address=ray_head.address, quiet=True)["steps"] == TRAINED_STEPS + 4
    events = _events(run_dir)
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[-1] == {**restored[-1], "step": TRAINED_STEPS, "from_strategy": "fsdp", "from_world_size": 2}
    after = [e for e in events if e["event"] == "progress" and e["time"] > restored[-1]["time"]][0]["loss"]
    initial = first["initial_val_loss"]
    # The restored model continues where it stopped: nowhere near the untrained loss.
    assert after < before + 0.3 and after < initial - 1.5

    third = run_cs3(["train", *common, f"train.steps={TRAINED_STEPS + 6}", "parallel.strategy=zero1",
                     "cluster.workers=2", *ray_data, "--resume"], env=ray_head.env(), check=True)
    summary = json.loads(third.stdout.strip().splitlines()[-1])
    assert summary["steps"] == TRAINED_STEPS + 6 and summary["strategy"] == "zero1"
    restored = [e for e in _events(run_dir) if e["event"] == "restored"]
    assert restored[-1]["from_strategy"] == "ddp" and restored[-1]["from_world_size"] == 1

    # Steps x workers x batch of each run: the global batch follows each run's configured workers.
    seen = _traced(run_dir)
    consumed = (TRAINED_STEPS * 2 + 4 * 1 + 2 * 2) * BATCH
    assert len(seen) == consumed
    shards, _ = prepare_data(middle)  # the shards the runs trained on (from the data cache)
    order = GlobalOrder(read_manifest(shards)["splits"]["train"], middle.train.seed, middle.cache.shuffle_window)
    assert collections.Counter(seen) == collections.Counter(order.ids(0, consumed).tolist())
    assert len(set(seen)) == consumed  # within one epoch: nothing repeated
    # The transform ran in Ray Data's task processes, never in a training worker.
    workers = {pid for e in _events(run_dir) if e["event"] == "start" for pid in e["pids"]}
    ran = {int(p.name) for p in PIDS.iterdir()}
    assert ran and not ran & workers
