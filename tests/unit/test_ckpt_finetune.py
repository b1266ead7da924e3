"""Fine-tuning: frozen parameters get no gradient or optimizer state; init_from loads weights only."""

import pytest
import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.ckpt.finetune import load_init_weights
from cs3ray.config import ConfigError, load_config, to_yaml
from cs3ray.core.freeze import apply_freeze
from cs3ray.core.optim import build_optimizer
from cs3ray.core.state import capture, init_adamw_state
from cs3ray.models import ByteTokenizer, Transformer

ARGS = ["model.dim=32", "model.n_layers=3", "model.n_heads=4", "model.ffn_dim=64", "model.max_seq_len=32",
        "train.seq_len=16"]


def _model(seed):
    torch.manual_seed(seed)
    return Transformer(load_config(None, ARGS).model.args())


def test_freeze_then_train_from_init(tmp_path):
    pre = _model(1)
    opt = build_optimizer(pre, 1e-2, 0.1, (0.9, 0.95))
    init_adamw_state(opt)
    CheckpointManager(str(tmp_path / "pre")).save(
        10, capture(pre, opt), {"step": 10}, {"torch": torch.get_rng_state()},
        {"config.yaml": to_yaml(load_config(None, ARGS)), "tokenizer.json": ByteTokenizer().to_json()})

    model = _model(2)
    frozen = apply_freeze(model, ["tok_emb.*", "blocks.[0-1].*"])
    assert frozen and all(n.startswith(("tok_emb.", "blocks.0.", "blocks.1.")) for n in frozen)
    info = load_init_weights(model, str(tmp_path / "pre"))
    assert info["step"] == 10
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), pre.state_dict().values(), strict=True))

    opt = build_optimizer(model, 1e-2, 0.1, (0.9, 0.95))
    init_adamw_state(opt)
    names = set(capture(model, opt)["optim"]["state"])
    assert names and not names & set(frozen)  # frozen parameters get no optimizer state
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 256, (2, 17))
    logits = model(x[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


def test_freeze_pattern_that_matches_nothing_is_an_error():
    with pytest.raises(ConfigError, match="match no parameter"):
        apply_freeze(_model(0), ["embedding.*"])


def test_a_core_with_frozen_parameters_steps_with_memory_tracking_on():
    # The worker tracks peak memory on its second step; torch's tracker cannot hook frozen parameters.
    import numpy as np

    from cs3ray.core.engine import ComputeCore
    from cs3ray.core.mesh import Topology

    cfg = load_config(None, [*ARGS, "train.batch_size=2", 'train.freeze=["tok_emb.*"]', "precision=fp32"])
    core = ComputeCore(cfg, torch.device("cpu"), Topology(0, 1, 1, ("n0",)))
    batch = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int64)
    before = core.model.tok_emb.weight.detach().clone()
    _, applied = core.step(lambda: batch, 1e-2, track_memory=True)
    assert applied and core.frozen and torch.equal(core.model.tok_emb.weight, before)
