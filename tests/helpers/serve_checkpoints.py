"""Make real checkpoints quickly (no Ray Train) for serving tests: random weights, tiny shape."""

from __future__ import annotations

from pathlib import Path

import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import load_config, to_yaml
from cs3ray.models import ByteTokenizer, Transformer

ROOT = Path(__file__).resolve().parents[2]


def make_checkpoint(run_dir: Path, step: int = 1, seed: int = 0, overrides: list[str] | None = None,
                    keep: int = 5, tokenizer_json: str | None = None) -> str:
    """Save a tiny model's checkpoint under run_dir/step-XXXXXXXX exactly as training would; returns its URL."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"run.dir={run_dir}", *(overrides or [])])
    torch.manual_seed(seed)
    model = Transformer(cfg.model.args())
    meta = {"step": step, "world_size": 1, "strategy": "ddp", "precision": cfg.precision}
    files = {"config.yaml": to_yaml(cfg), "tokenizer.json": tokenizer_json or ByteTokenizer().to_json()}
    return CheckpointManager(str(run_dir), keep=keep).save(step, {"model": model.state_dict(), "optim": {}}, meta,
                                                           {}, files)
