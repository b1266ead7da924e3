"""A checkpoint written by FSDP on 2 workers resumes with DDP on 1 worker (and back), loss continuous."""

import json

from conftest import run_cs3

FAST = ["train.log_every=2", "train.eval_every=100", "train.eval_batches=2", "checkpoint.every=100",
        "train.warmup_steps=2"]


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_fsdp_x2_then_ddp_x1_then_zero1_x2(ray_head, tmp_path):
    run_dir = tmp_path / "reshard"
    common = ["configs/tiny.yaml", f"run.dir={run_dir}", *FAST, "--address", ray_head.address, "--json"]
    first = run_cs3(["train", *common, "train.steps=16", "parallel.strategy=fsdp", "cluster.workers=2"],
                    env=ray_head.env(), check=True)
    before = [e for e in _events(run_dir) if e["event"] == "progress"][-1]["loss"]
    run_cs3(["train", *common, "train.steps=20", "parallel.strategy=ddp", "cluster.workers=1", "--resume"],
            env=ray_head.env(), check=True)
    events = _events(run_dir)
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[-1] == {**restored[-1], "step": 16, "from_strategy": "fsdp", "from_world_size": 2}
    after = [e for e in events if e["event"] == "progress" and e["time"] > restored[-1]["time"]][0]["loss"]
    initial = json.loads(first.stdout.strip().splitlines()[-1])["initial_val_loss"]
    # The restored model continues where it stopped: nowhere near the untrained loss.
    assert after < before + 0.3 and after < initial - 1.5
    third = run_cs3(["train", *common, "train.steps=22", "parallel.strategy=zero1", "cluster.workers=2", "--resume"],
                    env=ray_head.env(), check=True)
    summary = json.loads(third.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 22 and summary["strategy"] == "zero1"
    restored = [e for e in _events(run_dir) if e["event"] == "restored"]
    assert restored[-1]["from_strategy"] == "ddp" and restored[-1]["from_world_size"] == 1
