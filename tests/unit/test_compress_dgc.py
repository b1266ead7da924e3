"""DGC for int4_sparse on real tensors: local clipping, momentum correction, momentum factor masking, the
warm-up of falling density, and velocities that follow the residuals' rules (loss scale, fp16 rollback,
pruning, checkpoint) through the real two-rank exchange and engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cs3ray.config import ConfigError, load_config
from cs3ray.core.compress import CompressedAllReduce, make_codec
from cs3ray.core.compress.dgc import DgcSettings, MomentumCorrection, clip_local, warmup_density
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology

from helpers.core import MODEL, steps_with_an_overflow
from helpers.ranks import gloo_ranks


def _grads(steps: int, n: int = 4000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


def test_warmup_density_falls_exponentially_to_the_codecs_density():
    s = DgcSettings(warmup_steps=4, warmup_density=0.8)
    shares = [warmup_density(t, s, 0.05) for t in range(6)]
    assert shares[0] == pytest.approx(0.8) and shares[4:] == [0.05, 0.05]
    ratios = [b / a for a, b in zip(shares[:4], shares[1:5], strict=True)]
    assert ratios == pytest.approx([(0.05 / 0.8) ** 0.25] * 4)  # the same factor every step
    assert warmup_density(0, DgcSettings(warmup_steps=0), 0.1) == 0.1


def test_local_clipping_bounds_the_norm_by_clip_over_sqrt_workers_in_loss_scale_units():
    g = torch.full((100,), 1.0)  # norm 10
    assert clip_local(g, 2.0, world=4, scale=8.0) == pytest.approx(8.0 / 10)  # bound 8 * 2 / 2
    assert float(torch.linalg.vector_norm(g)) == pytest.approx(8.0)
    small = torch.full((100,), 0.01)
    assert clip_local(small, 2.0, world=4) == 1.0 and torch.equal(small, torch.full((100,), 0.01))
    assert clip_local(g, 0.0, world=4) == 1.0  # off


def test_momentum_correction_accumulates_a_velocity_and_sends_it():
    mc = MomentumCorrection(0.9, masking=False)
    u = torch.zeros(4000)
    for g in _grads(3):
        x = g.clone()
        mc.accumulate("b", x)
        u = 0.9 * u + g
        assert torch.allclose(x, u) and torch.allclose(mc.velocities["b"], u)
        mc.commit()
    # A second sync of the key in one step (FSDP2's micro-batches) adds its gradient and sends it alone.
    g1, g2 = _grads(2)
    x1, x2 = g1.clone(), g2.clone()
    mc.accumulate("b", x1)
    mc.accumulate("b", x2)
    assert torch.equal(x2, g2) and torch.allclose(mc.velocities["b"], 0.9 * u + g1 + g2)


def test_factor_masking_zeroes_the_velocity_where_values_were_sent():
    mc = MomentumCorrection(0.9)
    x = _grads(1, 1000)[0]
    mc.accumulate("b", x.clone())
    codec = make_codec("int4_sparse", 0.1)
    _, sent = codec.encode_sent(x[:600].clone(), None, None)
    mc.mask("b", 0, sent)
    u = mc.velocities["b"]
    hit = sent != 0
    assert 50 <= int(hit.sum()) <= 60 and torch.all(u[:600][hit] == 0) and torch.equal(u[:600][~hit], x[:600][~hit])
    mc.mask("b", 900, torch.ones(200))  # a padded last chunk reaches past the tensor
    mc.mask_all("b", 600, 100)  # a rank's own chunk, sent in full
    assert torch.all(u[600:700] == 0) and torch.all(u[900:] == 0) and torch.equal(u[700:900], x[700:900])


def test_velocities_follow_the_loss_scale_roll_back_and_are_pruned():
    mc = MomentumCorrection(0.5, transactional=True)
    g0, g1 = _grads(2)
    mc.accumulate("b", g0 * 4)
    mc.set_scale(1.0)
    mc.commit()
    mc.set_scale(4.0)  # velocities in the units of the next gradients
    assert torch.allclose(mc.velocities["b"], g0 * 16)
    committed = mc.velocities["b"].clone()
    mc.accumulate("b", g1 * 4)
    mc.rollback()  # an overflowed fp16 step: nothing changes
    assert torch.equal(mc.velocities["b"], committed)
    mc.velocities["gone"] = torch.ones(3)  # a checkpoint's from another layout
    mc.accumulate("b", g1 * 4)
    mc.commit()
    assert set(mc.velocities) == {"b"} and torch.allclose(mc.velocities["b"], 0.5 * committed + g1 * 4)
    assert mc.nbytes() == 2 * 4000 * 4  # the velocity and its transactional spare


def _exchange(rank: int, world: int, results: dict) -> None:
    """The real two-phase exchange with DGC velocities: masked where this rank's values went out."""
    reduce = CompressedAllReduce(make_codec("int4_sparse", 0.1))
    reduce.momentum = MomentumCorrection(0.9)
    g = _grads(rank + 1, 2000)[rank]
    flat = g.clone()
    reduce.momentum.accumulate("b", flat)
    reduce("b", flat)
    u = reduce.momentum.velocities["b"]
    peer = 1 - rank
    span = slice(peer * 1000, (peer + 1) * 1000)
    results.update(own_zero=bool(torch.all(u[rank * 1000:(rank + 1) * 1000] == 0)),
                   sent=int((u[span] == 0).sum()), kept=bool(torch.equal(u[span][u[span] != 0], g[span][u[span] != 0])))


def test_the_exchange_masks_the_velocity_of_what_each_rank_sent():
    for rank, r in gloo_ranks(_exchange, 2).items():
        assert "error" not in r, r.get("error")
        # Its own chunk is summed exact (sent in full); of the peer's chunk 10% went out, 4-bit.
        assert r["own_zero"] and 90 <= r["sent"] <= 100 and r["kept"], (rank, r)


def _fp16_dgc(rank: int, world: int, results: dict, strategy: str) -> None:
    """fp16 int4_sparse with DGC in the engine: a step rank 1 overflows is skipped with every velocity kept;
    the state saved and loaded carries them."""
    cfg = load_config(None, MODEL + [f"cluster.workers={world}", "compression.codec=int4_sparse", "precision=fp16",
                                     "compression.warmup_steps=0", "compression.dgc.momentum=0.9",
                                     f"parallel.strategy={strategy}"])
    core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, 1, ("n0",) * world))
    mc = core.compression.momentum
    applied, snapshots = steps_with_an_overflow(
        core, rank, lambda: {str(k): (v / mc.scale).numpy().copy() for k, v in mc.velocities.items()})
    state = core.compression_state()
    core.load_compression_state(state, step=4)
    restored = core.compression.momentum.velocities
    results.update(applied=applied, before=snapshots[1], after=snapshots[2],
                   restored=set(map(str, restored)) == set(map(str, state["velocities"])) and bool(restored),
                   counted=core.memory()["residual_bytes"] >= core.compression.momentum.nbytes() > 0)
    core.compression.reduce.close()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_overflow_skipped_step_keeps_every_velocity_and_checkpoints_carry_them(strategy):
    for rank, r in gloo_ranks(_fp16_dgc, 2, strategy).items():
        assert "error" not in r, r.get("error")
        assert r["applied"] == [True, True, False, True], (rank, r["applied"])
        assert r["before"] and r["before"].keys() == r["after"].keys()
        assert all(np.array_equal(r["before"][k], r["after"][k]) for k in r["before"]), rank
        assert r["restored"] and r["counted"], rank


def test_dgc_settings_validate_in_one_sentence():
    c = load_config(None, ["compression.codec=int4_sparse"]).compression
    assert c.dgc.enabled is None and c.dgc.momentum == 0.0 and c.dgc.factor_masking and c.dgc.warmup_steps > 0
    for overrides, needle in ((["compression.dgc.momentum=1"], "compression.dgc.momentum"),
                              (["compression.dgc.warmup_density=0"], "compression.dgc.warmup_density"),
                              (["compression.codec=int4_sparse", "compression.hierarchical=true",
                                "compression.dgc.enabled=true"], "compression.dgc.enabled=true cannot")):
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert needle in str(info.value) and "\n" not in str(info.value)
    assert math.isclose(load_config(None, ["compression.dgc.clip_norm=0.5"]).compression.dgc.clip_norm, 0.5)
