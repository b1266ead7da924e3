"""The two-phase compressed all-reduce on 2 real gloo ranks: the fp32 mean within each codec's bound,
identical on every rank, exact byte counts; with error feedback the sparse codec's average over steps
converges to the true mean; DDP with each codec trains."""

import io

import pytest
import torch

from cs3ray.core.compress import CompressedAllReduce, CompressionHook, allreduce, error_bound, make_codec, ring_bytes

from helpers.core import global_batches, run_distributed
from helpers.ranks import gloo_ranks

WORLD = 2
N = 5003  # odd: the chunks are padded


def _inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N, generator=g) * torch.logspace(-3, 1, N)


def _collective(rank: int, world: int, results: dict) -> None:
    x = _inputs(rank)
    for name in ("none", "bf16", "int8", "int4_sparse"):
        reduce = CompressedAllReduce(make_codec(name), error_feedback=False)
        results[name] = (reduce("g", x).numpy(), reduce.stats.bytes_sent)
    # Error feedback on both phases: the average of many syncs of one gradient approaches its mean.
    reduce = CompressedAllReduce(make_codec("int4_sparse"), error_feedback=True)
    steps = 40
    results["ef_mean"] = (sum(reduce.start("g", x).wait() for _ in range(steps)) / steps).numpy()
    # Residuals through a checkpoint file: a fresh hook loaded from it continues exactly as the original.
    hook = CompressionHook("int4_sparse")
    for _ in range(3):
        hook.reduce("g", x)
    buf = io.BytesIO()
    torch.save(hook.state_dict(), buf)
    resumed = CompressionHook("int4_sparse")
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), steps=3)
    results["resumed"] = (hook.reduce("g", x).numpy(), resumed.reduce("g", x).numpy(), resumed.steps)
    # The same syncs with each chunk encoded and sent in 1024-value pieces (3 per chunk here).
    whole = allreduce.PIECE
    for name in ("bf16", "int8"):
        runs = []
        for piece in (whole, 1024):
            allreduce.PIECE = piece
            try:
                reduce = CompressedAllReduce(make_codec(name), error_feedback=True)
                runs.append(([reduce("g", x).numpy() for _ in range(2)], reduce.stats.bytes_sent))
            finally:
                allreduce.PIECE = whole
        results[f"pieces-{name}"] = runs


@pytest.fixture(scope="module")
def reduced():
    results = gloo_ranks(_collective, WORLD, timeout=120)
    for r in results.values():
        assert "error" not in r, r["error"]
    return results


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "int4_sparse"])
def test_compressed_mean_is_within_the_codec_bound_and_identical_on_every_rank(reduced, name):
    codec = make_codec(name)
    xs = [_inputs(r) for r in range(WORLD)]
    mean = sum(xs) / WORLD
    got, sent = torch.from_numpy(reduced[0][name][0]), reduced[0][name][1]
    assert torch.equal(got, torch.from_numpy(reduced[1][name][0]))  # replicas stay bit-identical
    # Phase 1 error: each rank's chunk error, averaged; phase 2: the error of re-encoding the reduced chunk,
    # whose values lie within the phase-1 error of the mean. Bounds are per chunk, so compute them per chunk.
    half = (N + 1) // 2
    tol = torch.cat([sum(error_bound(codec, x[s]) for x in xs) / WORLD for s in (slice(0, half), slice(half, N))])
    near = mean.abs() + tol
    tol = tol + torch.cat([error_bound(codec, near[s]) for s in (slice(0, half), slice(half, N))])
    assert bool(((got - mean).abs() <= tol * 1.001 + 1e-7).all()), float(((got - mean).abs() - tol).max())
    assert sent == 2 * (WORLD - 1) * codec.wire_bytes(half)
    if name == "none":
        assert torch.allclose(got, mean, rtol=1e-6, atol=1e-7)
        assert sent == pytest.approx(ring_bytes(N, WORLD), rel=1e-3)


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_a_chunk_sent_in_pieces_gives_the_same_means_and_bytes(reduced, name):
    (whole, whole_bytes), (pieces, piece_bytes) = reduced[0][f"pieces-{name}"]
    assert piece_bytes == whole_bytes
    for a, b in zip(whole, pieces, strict=True):  # two steps: the residuals carried over match too
        assert (a == b).all()


def test_error_feedback_makes_sparse_sync_unbiased_over_steps(reduced):
    mean = sum(_inputs(r) for r in range(WORLD)) / WORLD
    one_shot = (torch.from_numpy(reduced[0]["int4_sparse"][0]) - mean).norm() / mean.norm()
    averaged = (torch.from_numpy(reduced[0]["ef_mean"]) - mean).norm() / mean.norm()
    assert one_shot > 0.2  # 90% of the values dropped in a single sync
    assert averaged < 0.15 * one_shot, (float(one_shot), float(averaged))


def test_residuals_survive_a_checkpoint_file(reduced):
    for rank in range(WORLD):
        continued, resumed, steps = reduced[rank]["resumed"]
        assert (continued == resumed).all() and steps == 3


STEPS = 6
JOBS = [(f"{codec}-{prec}", [f"compression.codec={codec}", f"precision={prec}"])
        for codec, prec in (("none", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int4_sparse", "fp32"),
                            ("int8", "bf16"), ("int8", "fp16"))]
JOBS.append(("int8-warmup", ["compression.codec=int8", "precision=fp32", "compression.warmup_steps=3"]))
JOBS.append(("int8-zero1", ["compression.codec=int8", "precision=fp32", "parallel.strategy=zero1"]))
JOBS += [(f"fsdp-{codec}-{prec}", [f"compression.codec={codec}", f"precision={prec}", "parallel.strategy=fsdp"])
         for codec, prec in (("none", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int4_sparse", "fp32"),
                             ("int8", "bf16"))]
# int4_sparse's bytes are counted at its steady density: DGC's warm-up of denser steps off.
JOBS = [(name, ov + ["compression.dgc.warmup_steps=0"] if "int4_sparse" in name else ov) for name, ov in JOBS]
# Rank 1's gradients overflow on the 3rd step: the decoded bucket must stay non-finite so both ranks skip it.
OVERFLOW = ("int8-fp16-overflow", ["compression.codec=int8", "precision=fp16"], {"inject_inf_at": 2, "inject_rank": 1})


@pytest.fixture(scope="module")
def trained():
    # The same global batch every step: the model memorises it, so the loss falls clearly in a few steps.
    batches = global_batches(1, rows=8) * STEPS
    return run_distributed([*JOBS, OVERFLOW], batches, world=WORLD)


@pytest.mark.parametrize("job", [name for name, _ in JOBS])
def test_each_codec_trains(trained, job):
    r = trained["rank0"][job]
    losses, base = r["losses"], trained["rank0"]["fsdp-none-fp32" if "fsdp" in job else "none-fp32"]["losses"]
    assert all(r["applied"]) and len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.5, losses
    # Share of the uncompressed run's loss drop reached: 90% of the values dropped per step slow int4_sparse
    # down over a few steps (error feedback delivers them later).
    share = 0.5 if "int4_sparse" in job else 0.9
    assert losses[0] - losses[-1] >= share * (base[0] - base[-1]), (losses, base)
    assert r["master_dtypes"] == ["torch.float32"]


def test_compressed_runs_count_their_bytes_and_residuals(trained):
    stats = {name: trained["rank0"][name]["comm"] for name, _ in JOBS}
    assert stats["none-fp32"] is None and stats["fsdp-none-fp32"] is None
    # The first sync of a process is fp32 (DDP's initial buckets): the ratio of the compressed ones.
    ratios = {name: (STEPS * s["wire_ratio"] - 1) / (STEPS - 1) for name, s in stats.items() if s}
    assert all(s["syncs"] == STEPS for s in stats.values() if s)
    assert 0.49 < ratios["bf16-fp32"] <= 0.51
    assert 0.25 <= ratios["int8-fp32"] <= 0.27
    assert ratios["int4_sparse-fp32"] <= 0.0625 + 0.01  # tiny buckets: scale and padding bytes weigh more
    # Three of six steps uncompressed: halfway between fp32 and int8.
    assert stats["int8-warmup"]["wire_ratio"] == pytest.approx((1 + ratios["int8-fp32"]) / 2, rel=0.02)
    mem = trained["rank0"]["int8-fp32"]["memory"]
    # One gradient: the sender's residual for the N-1 chunks it sends and the owner's for its own; none
    # left behind by the buckets DDP rebuilds after the first step.
    assert 0.9 * mem["grad_bytes"] <= mem["residual_bytes"] <= 1.1 * mem["grad_bytes"], mem
    assert mem["state_bytes"] == mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"] + mem["residual_bytes"]
    assert trained["rank0"]["none-fp32"]["memory"]["residual_bytes"] == 0


def test_an_overflow_on_one_rank_is_skipped_on_every_rank(trained):
    for rank in ("rank0", "rank1"):
        r = trained[rank]["int8-fp16-overflow"]
        assert r["applied"] == [True, True, False] and r["skipped"] == 1, r
        assert r["scale"] == 2.0**15


def test_fsdp_reduce_scatter_is_compressed_and_its_residual_covers_the_chunks_it_sends(trained):
    fsdp, ddp = trained["rank0"]["fsdp-int8-fp32"], trained["rank0"]["int8-fp32"]
    # The baseline of FSDP's ratio is an fp32 ring reduce-scatter.
    assert 0.25 <= fsdp["comm"]["wire_ratio"] <= 0.27 and fsdp["comm"]["syncs"] == STEPS
    assert trained["rank0"]["fsdp-int4_sparse-fp32"]["comm"]["wire_ratio"] <= 0.0625 + 0.01
    mem = fsdp["memory"]
    # Each rank keeps a residual for the other ranks' chunks of the unsharded gradient: N-1 times its
    # gradient shard, (N-1)/N of the whole gradient.
    assert 0.95 * mem["grad_bytes"] <= mem["residual_bytes"] <= 1.1 * mem["grad_bytes"], mem
    assert mem["residual_bytes"] >= 0.95 * ddp["memory"]["grad_bytes"] / 2
