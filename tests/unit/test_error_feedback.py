"""Error feedback done right: residuals in gradient units whatever the fp16 loss scale, a skipped step
leaves them exactly as they were, and residuals no compressed step uses any more are dropped.

Each codec's encode is scale-invariant under the scaler's powers of two, so an fp16 run's residuals,
divided by its scale, equal an unscaled fp32 reference bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cs3ray.config import load_config
from cs3ray.core.compress.codec import make_codec
from cs3ray.core.compress.feedback import ErrorFeedback
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology

from helpers.core import MODEL, steps_with_an_overflow
from helpers.ranks import gloo_ranks

CODECS = ["int8", "int4_sparse"]


def _grads(steps: int, n: int = 3000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) * 1e-3 for _ in range(steps)]


def _unscaled(fb: ErrorFeedback) -> dict:
    return {k: v / fb.scale for k, v in fb.residuals.items()}


@pytest.mark.parametrize("codec", CODECS)
def test_residuals_follow_the_loss_scale_and_equal_an_unscaled_reference(codec):
    c = make_codec(codec, 0.1)
    reference, scaled = ErrorFeedback(), ErrorFeedback(transactional=True)
    scales = [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16]  # a back-off, then growth
    for g, s in zip(_grads(len(scales)), scales, strict=True):
        ref_payload, _ = reference.encode("bucket", c, g)
        ref_payload = ref_payload.clone()
        reference.commit()
        scaled.set_scale(s)
        payload, _ = scaled.encode("bucket", c, g * s)
        scaled.commit()
        got = _unscaled(scaled)["bucket"]
        assert torch.equal(got, reference.residuals["bucket"]), (codec, s)
        assert torch.equal(c.decode(payload, g.numel()) / s, c.decode(ref_payload, g.numel()))


@pytest.mark.parametrize("codec", CODECS)
def test_a_skipped_step_leaves_every_residual_as_it_was(codec):
    c = make_codec(codec, 0.1)
    fb = ErrorFeedback(transactional=True)
    g = _grads(3)
    fb.set_scale(2.0 ** 16)
    for key in ("a", "b"):
        fb.encode(key, c, g[0] * fb.scale)
    fb.commit()
    before = {k: v.clone() for k, v in fb.residuals.items()}
    # The overflowing step: one tensor finite (it would have absorbed the step), one with an inf.
    bad = g[1].clone() * fb.scale
    bad[7] = float("inf")
    fb.encode("a", c, g[1] * fb.scale)
    fb.encode("b", c, bad)
    fb.rollback()
    assert fb.residuals.keys() == before.keys()
    assert all(torch.equal(fb.residuals[k], before[k]) for k in before)
    # The scaler backs off; the next step starts from the residuals before the skipped one.
    reference = ErrorFeedback(transactional=True)
    reference.residuals = {k: v.clone() for k, v in before.items()}
    reference.scale = fb.scale
    for f in (fb, reference):
        f.set_scale(2.0 ** 15)
        f.encode("a", c, g[2] * f.scale)
        f.commit()
    assert torch.equal(fb.residuals["a"], reference.residuals["a"])


def test_accumulated_encodes_of_one_key_build_on_the_same_step():
    # FSDP reduce-scatters every micro-batch: the second encode of a key continues from the first's residual.
    c = make_codec("int8", 0.1)
    g = _grads(2)
    one, two = ErrorFeedback(transactional=True), ErrorFeedback()
    for f in (one, two):
        for x in g:
            f.encode("unit", c, x)
        f.commit()
    assert torch.equal(one.residuals["unit"], two.residuals["unit"])


def test_residuals_no_compressed_step_uses_are_dropped():
    c = make_codec("int8", 0.1)
    for fb in (ErrorFeedback(), ErrorFeedback(transactional=True)):
        fb.encode("gone", c, _grads(1)[0])
        fb.encode("kept", c, _grads(1)[0])
        fb.commit()
        fb.commit()  # a step with no encode (warm-up, DDP's first sync) keeps them
        assert set(fb.residuals) == {"gone", "kept"}
        fb.encode("kept", c, _grads(1)[0])
        fb.commit()
        assert set(fb.residuals) == {"kept"} and set(fb.pending) <= {"kept"}


WORLD = 2


def _overflow_run(rank: int, world: int, results: dict, strategy: str) -> None:
    """fp16 int8 on 2 gloo ranks: two steps, a third that overflows on rank 1 only (skipped on both), a fourth."""
    cfg = load_config(None, MODEL + [f"cluster.workers={world}", "compression.codec=int8", "precision=fp16",
                                     "compression.warmup_steps=0", f"parallel.strategy={strategy}"])
    core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, 1, ("n0",) * world))
    if strategy == "fsdp":  # a residual of a module that no longer exists (an older checkpoint's)
        core.compression.reduce.feedback.residuals["gone"] = torch.ones(8)
    fb = core.compression.reduce.feedback
    applied, snapshots = steps_with_an_overflow(
        core, rank, lambda: {str(k): (v / fb.scale).numpy().copy() for k, v in fb.residuals.items()})
    results.update(applied=applied, snapshots=snapshots, scale=core.scaler.scale)
    core.compression.reduce.close()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_overflow_skipped_step_keeps_every_ranks_residuals(strategy):
    results = gloo_ranks(_overflow_run, WORLD, strategy)
    for rank, r in results.items():
        assert "error" not in r, r.get("error")
        assert r["applied"] == [True, True, False, True], (rank, r["applied"])
        before, after = r["snapshots"][1], r["snapshots"][2]
        assert before and before.keys() == after.keys()
        assert all(np.array_equal(before[k], after[k]) for k in before), rank
        assert any(not np.array_equal(after[k], r["snapshots"][3][k]) for k in after)  # the next step moves them
        assert "gone" not in r["snapshots"][0]
