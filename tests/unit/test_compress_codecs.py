"""Each gradient codec stays within its error bound, sends exactly the bytes it accounts for, and error
feedback loses nothing: transmitted + residual == input, exactly in fp32."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cs3ray.core.compress import ErrorFeedback, error_bound, make_codec, ring_bytes

CODECS = ["none", "bf16", "int8", "int4_sparse"]
# Gradient-like values: finite fp32, magnitudes spread over many binades, some exact zeros.
_values = st.one_of(st.just(0.0), st.floats(-1e6, 1e6, width=32, allow_subnormal=False))
_grads = st.integers(1, 1500).flatmap(lambda n: arrays("float32", n, elements=_values))


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=40, deadline=None)
@given(x=_grads)
# A block whose absmax / 127 is subnormal (no finite reciprocal).
@example(x=np.array([5e-38, 1.2e-38, 0.0], dtype=np.float32))
def test_roundtrip_within_bound_and_payload_size_exact(name, x):
    codec = make_codec(name)
    t = torch.from_numpy(x)
    payload = codec.encode(t)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.wire_bytes(t.numel())
    assert payload.numel() % 4 == 0
    back = codec.decode(payload, t.numel())
    assert back.dtype == torch.float32 and back.shape == t.shape
    assert bool(((back - t).abs() <= error_bound(codec, t)).all())


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=25, deadline=None)
@given(steps=st.lists(_grads.filter(lambda a: len(a) >= 1), min_size=1, max_size=3), n=st.integers(1, 700))
# A block whose absmax / 127 is subnormal: its zeros must still be sent (and kept back) as zeros.
@example(steps=[np.array([1.1754944e-38, 0.0], dtype=np.float32)], n=2)
def test_error_feedback_transmitted_plus_residual_is_the_input_exactly(name, steps, n):
    codec, ef = make_codec(name), ErrorFeedback()
    for x in steps:
        g = torch.from_numpy(x[:n].copy()) if len(x) >= n else torch.from_numpy(x)
        res = ef.residuals.get("b")
        want = g + res if res is not None and res.numel() == g.numel() else g
        _, sent = ef.encode("b", codec, g)
        # The exact codec keeps no residual.
        assert torch.equal(sent + ef.residuals.get("b", torch.zeros_like(g)), want)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 200_000), density=st.sampled_from([0.01, 0.05, 0.1, 0.3]))
def test_int4_sparse_keeps_the_density_and_picks_the_cheaper_position_format(n, density):
    codec = make_codec("int4_sparse", density)
    k = codec.kept(n)
    assert k == max(1, math.ceil(density * n))
    index_bytes = (2 if n <= 2**15 else 4) * k
    expected = 4 * math.ceil(k / 256) + min(math.ceil(n / 8), index_bytes) + math.ceil(k / 2)
    assert codec.wire_bytes(n) == expected + (-expected % 4)


def test_int4_sparse_sends_the_largest_values_and_zeros_the_rest():
    torch.manual_seed(0)
    x = torch.randn(10_000)
    back = make_codec("int4_sparse", 0.1).roundtrip(x)
    top = torch.zeros(10_000, dtype=torch.bool)
    top[torch.topk(x.abs(), 1000).indices] = True
    sent = back != 0  # a kept value may round to 0 at 4 bits
    assert 900 <= int(sent.sum()) <= 1000 and not bool((sent & ~top).any())


@pytest.mark.parametrize("name", ["bf16", "int8", "int4_sparse"])
def test_overflow_stays_visible_and_does_not_poison_the_residual(name):
    codec, ef = make_codec(name), ErrorFeedback()
    x = torch.linspace(-1, 1, 600)
    x[17] = float("inf")
    _, sent = ef.encode("b", codec, x)
    assert not bool(torch.isfinite(sent).all())  # the fp16 loss scaler must still see the overflow
    assert bool((ef.residuals["b"] == 0).all())
    _, sent = ef.encode("b", codec, torch.linspace(-1, 1, 600))
    assert bool(torch.isfinite(sent).all())


@pytest.mark.parametrize("name,limit", [("bf16", 0.5), ("int8", 0.26), ("int4_sparse", 0.0625)])
def test_wire_ratio_targets_for_a_large_gradient(name, limit):
    n, world = 25 * 2**20 // 4, 2  # one 25 MiB DDP bucket
    chunk = math.ceil(n / world)
    sent = 2 * (world - 1) * make_codec(name).wire_bytes(chunk)
    assert sent / ring_bytes(n, world) <= limit


@pytest.mark.parametrize("density", [0.01, 0.1, 0.6])
def test_int4_sparse_on_a_large_gradient_sends_exactly_the_top_k(density):
    # Large inputs pick candidates by a sampled threshold first; the result must still be the exact top-k.
    torch.manual_seed(1)
    x = torch.randn(400_000) * torch.rand(400_000)
    x[3] = float("inf")
    codec = make_codec("int4_sparse", density)
    k = codec.kept(x.numel())
    want = torch.zeros(x.numel(), dtype=torch.bool)
    want[torch.topk(x.abs(), k).indices] = True
    payload = codec.encode(x)
    assert payload.numel() == codec.wire_bytes(x.numel())
    back = codec.decode(payload, x.numel())
    assert not bool((back.ne(0) & ~want).any()) and int(back.ne(0).sum()) >= 0.9 * k
