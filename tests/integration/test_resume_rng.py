"""A resumed run continues the random streams it saved: dropout after a resume draws what an
uninterrupted run draws, so both end with the same weights."""

import torch

from cs3ray.ckpt.export import consolidated_model
from cs3ray.config import load_config

# A constant learning rate, so a 2-step run and a 4-step run take the same first two steps.
COMMON = ["model.target=tests.helpers.dropout_model:build", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
          "train.batch_size=4", "train.seq_len=32", "train.eval_every=100", "train.eval_batches=1",
          "train.log_every=1", "checkpoint.every=100", "cluster.workers=1", "parallel.strategy=ddp",
          "precision=fp32"]


def test_resume_continues_the_saved_rng_streams(ray_head, tmp_path):
    from cs3ray.train import train

    def run(name: str, steps: int, resume: bool = False):
        cfg = load_config("configs/tiny.yaml", [*COMMON, f"run.dir={tmp_path / name}", f"run.name={name}",
                                                f"train.steps={steps}"])
        return train(cfg, resume=resume, address=ray_head.address, quiet=True)

    run("whole", 4)
    run("split", 2)
    assert run("split", 4, resume=True)["steps"] == 4
    whole, _ = consolidated_model(str(tmp_path / "whole"))
    split, _ = consolidated_model(str(tmp_path / "split"))
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)
