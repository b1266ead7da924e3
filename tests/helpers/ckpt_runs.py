"""Small checkpointed runs written by CheckpointManager in the test process (no Ray), and ways to damage them."""

from __future__ import annotations

from pathlib import Path

import torch

from cs3ray.ckpt import CheckpointManager, read_manifest
from cs3ray.config import load_config, to_yaml
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.storage import open_url

ARGS = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64", "model.max_seq_len=32",
        "train.seq_len=16"]


def small_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(load_config(None, ARGS).model.args())


def save(mgr: CheckpointManager, model: torch.nn.Module, step: int, overrides: list[str] | None = None) -> str:
    """One checkpoint of `model` as training writes it (config with `overrides`, tokenizer, state, RNG); its URL."""
    cfg = load_config(None, ARGS + list(overrides or []))
    files = {"config.yaml": to_yaml(cfg), "tokenizer.json": ByteTokenizer().to_json()}
    return mgr.save(step, {"model": model.state_dict()}, {"step": step, "tokens_seen": step * 10},
                    {"torch": torch.get_rng_state()}, files)


def load(mgr: CheckpointManager, step: int | None = None) -> tuple[int, Transformer]:
    """(step, a fresh model with the weights `mgr.load` restored)."""
    fresh = small_model(seed=99)
    state = {"model": fresh.state_dict()}
    got, _, _ = mgr.load(state, step)
    fresh.load_state_dict(state["model"])
    return got, fresh


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def newest_only_chunk(run: Path, step: int, previous: int) -> Path:
    """The largest chunk that checkpoint `step` has and `previous` does not (so damaging it spares `previous`)."""
    new = read_manifest(open_url(str(run / f"step-{step:08d}")))["chunks"]
    old = read_manifest(open_url(str(run / f"step-{previous:08d}")))["chunks"]
    h = max(set(new) - set(old), key=new.get)
    return run / "chunks" / h[:2] / h


def flip_byte(path: Path) -> None:
    """Corrupt a file in place, keeping its size (only a checksum notices)."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
