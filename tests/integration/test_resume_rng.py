"""A resumed run continues the random streams it saved: dropout after a resume draws what an
uninterrupted run draws, so both end with the same weights."""

import json
import shutil

import torch

from cs3ray.ckpt.export import consolidated_model
from cs3ray.config import load_config

# A dropout model (its masks are what the saved RNG streams must reproduce) and a checkpoint every 2 steps.
COMMON = ["model.target=tests.helpers.dropout_model:build", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
          "train.batch_size=4", "train.seq_len=32", "train.eval_every=100", "train.eval_batches=1",
          "train.log_every=1", "checkpoint.every=2", "cluster.workers=1", "parallel.strategy=ddp",
          "precision=fp32"]


def test_resume_continues_the_saved_rng_streams(ray_head, ray_client, tmp_path):
    from cs3ray.train import train

    def run(name: str, resume: bool = False):
        cfg = load_config("configs/tiny.yaml", [*COMMON, f"run.dir={tmp_path / name}", f"run.name={name}",
                                                "train.steps=4"])
        return train(cfg, resume=resume, address=ray_head.address, quiet=True)

    run("whole")  # 4 steps uninterrupted, with checkpoints at steps 2 and 4
    # The same run as if it had stopped after step 2: a copy without the step-4 checkpoint, resumed.
    shutil.copytree(tmp_path / "whole", tmp_path / "split", ignore=shutil.ignore_patterns("step-00000004"))
    assert run("split", resume=True)["steps"] == 4
    events = [json.loads(line) for line in (tmp_path / "split" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "restored"] == [2]
    whole, _ = consolidated_model(str(tmp_path / "whole"))
    split, _ = consolidated_model(str(tmp_path / "split"))
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)
