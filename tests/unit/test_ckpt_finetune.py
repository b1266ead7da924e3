"""Fine-tuning: frozen parameters get no gradient or optimizer state; init_from loads weights only."""

import pytest
import torch

from cs3ray.ckpt import CheckpointError, CheckpointManager
from cs3ray.ckpt.finetune import apply_freeze, load_init_weights
from cs3ray.config import load_config, to_yaml
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
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), pre.state_dict().values()))

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
    with pytest.raises(CheckpointError, match="match no parameter"):
        apply_freeze(_model(0), ["embedding.*"])
