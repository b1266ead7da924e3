"""Load balancing's pure parts: shares in proportion to speed, re-split only when persistently uneven, and the
stream's re-split micro-batches covering exactly the samples of the equal split, in the same global order."""

from __future__ import annotations

import pytest

from cs3ray.data.stream import TrainStream
from cs3ray.train.balance import Balancer, split_shares, step_time

from helpers.shard_sets import make_shard_set


def test_shares_follow_the_rates_and_add_up():
    assert split_shares(16, [1.0, 1.0]) == [8, 8]
    assert split_shares(16, [2.0, 1.0]) == [11, 5]  # 10.67 and 5.33: the larger remainder gets the row
    assert split_shares(12, [1.0, 1.0, 1.0, 3.0]) == [2, 2, 2, 6]
    assert split_shares(4, [100.0, 0.001]) == [3, 1]  # every rank keeps at least one row
    assert split_shares(5, [0.0, 0.0]) == [3, 2]
    with pytest.raises(ValueError, match="cannot give 3 ranks 2 each"):
        split_shares(5, [1, 1, 1], minimum=2)
    assert step_time([11, 5], [2.0, 1.0]) == 5.5 < step_time([8, 8], [2.0, 1.0]) == 8.0


def test_balancer_moves_only_when_persistently_uneven():
    b = Balancer([8, 8])
    assert b.observe([1.0, 1.02], [8, 8]) is None  # within the threshold: noise
    assert b.observe([1.0, 2.0], [8, 8]) is None  # once is not persistent
    assert b.observe([1.0, 1.0], [8, 8]) is None  # and the vote resets
    assert b.observe([1.0, 2.0], [8, 8]) is None
    assert b.observe([1.0, 2.0], [8, 8]) == [11, 5]
    assert b.shares == [11, 5]
    # Balanced now (rank 1 is half as fast and has half the rows... within rounding): nothing moves.
    assert b.observe([5.5, 5.0], [11, 5]) is None and b.observe([5.5, 5.0], [11, 5]) is None


def test_resplit_stream_covers_the_same_samples_in_the_same_order(tmp_path):
    src, _ = make_shard_set(tmp_path / "l3", n_shards=2)
    l2, world, batch = str(tmp_path / "l2"), 2, 4

    def streams():
        return [TrainStream(batch, 11, None, shards_url=src, cache={"disk_dir": l2}, rank=r, world=world)
                for r in range(world)]

    equal, split = streams(), streams()
    for s in split:
        s.reshare([6, 2])
    for _ in range(3):
        a = [next(s) for s in equal]
        b = [next(s) for s in split]
        assert [len(x) for x in b] == [6, 2]
        # The ranks' rows in rank order are the micro-batch in global order, split or not.
        assert [row.tolist() for x in a for row in x] == [row.tolist() for x in b for row in x]
    assert [s.position for s in split] == [s.position for s in equal] == [3 * world * batch] * world
    with pytest.raises(ValueError, match="must give each of 2 ranks at least one row and add up to 8"):
        split[0].reshare([8, 0])
    split[0].reshare([4, 4])
    assert split[0].shares is None  # equal shares are the plain split
    for s in equal + split:
        s.close()


def _balanced_ranks(rank: int, world: int, results: dict) -> None:
    """Each strategy trains 3 steps twice from the same seed: equal shares (4, 4), then (6, 2) of the same
    global batches with the balance weights; returns the losses as the loop reports them and the parameters."""
    import torch
    import torch.distributed as dist

    from cs3ray.config import load_config
    from cs3ray.core.engine import ComputeCore
    from cs3ray.core.mesh import Topology

    from helpers.core import MODEL, global_batches

    batches = global_batches(3, rows=8)
    for strategy, precision in (("ddp", "fp32"), ("zero1", "fp32"), ("fsdp", "fp32"), ("ddp", "bf16"),
                                ("ddp", "fp16")):
        for shares in ((4, 4), (6, 2)):
            cfg = load_config(None, MODEL + ["cluster.workers=2", f"parallel.strategy={strategy}",
                                             f"precision={precision}", "train.batch_size=4"])
            core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, 1, ("n0", "n0")))
            core.sample_weight = world * shares[rank] / sum(shares)
            losses, grads = [], []
            step_params = core.optimizer.step

            def capture(*args, step_params=step_params, grads=grads, core=core, **kwargs):
                # The synced gradient each optimizer step applies: what balancing must leave unchanged.
                grads.append({n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).numpy().copy()
                              for n, q in core.model.named_parameters()})
                return step_params(*args, **kwargs)
            core.optimizer.step = capture
            for gb in batches:
                lo = sum(shares[:rank])
                loss, ok = core.step(lambda rows=gb[lo:lo + shares[rank]]: rows, lr=cfg.train.lr)
                t = torch.tensor([loss * core.sample_weight], dtype=torch.float64)
                dist.all_reduce(t)
                losses.append(float(t) / world)
            state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy()
                     for k, v in core.model.state_dict().items()}
            results[(strategy, precision, shares)] = (losses, grads, state, core.busy.seconds)


@pytest.fixture(scope="module")
def balanced():
    from helpers.ranks import gloo_ranks

    results = gloo_ranks(_balanced_ranks, 2, timeout=300)
    for r in results.values():
        assert "error" not in r, r["error"]
    return results


def test_a_rebalanced_step_is_the_balanced_steps_update(balanced):
    results = balanced
    for strategy in ("ddp", "zero1", "fsdp"):
        for rank in (0, 1):
            (loss_a, grads_a, state_a, busy), (loss_b, grads_b, state_b, _) = (
                results[rank][(strategy, "fp32", s)] for s in ((4, 4), (6, 2)))
            assert loss_b == pytest.approx(loss_a, abs=1e-6), strategy
            for step_a, step_b in zip(grads_a, grads_b, strict=True):
                for key, value in step_a.items():
                    assert abs(step_b[key] - value).max() <= 1e-6, (strategy, key)
            # After 3 AdamW steps: the same up to fp32 rounding, which AdamW's normalisation amplifies where a
            # gradient is near its eps (how far depends on the CPU's kernels: up to ~1e-5 seen here).
            for key, value in state_a.items():
                assert abs(state_b[key] - value).max() <= 5e-5, (strategy, key)
            assert busy > 0


def test_balance_refuses_what_it_cannot_re_split():
    from cs3ray.config import load_config
    from cs3ray.errors import UserError

    from conftest import ROOT

    load_config(ROOT / "configs/tiny.yaml", ["train.balance=true", "parallel.strategy=fsdp"])
    load_config(ROOT / "configs/tiny.yaml", ["train.balance=true", "cluster.use_gpu=true"])  # timed by CUDA events
    for override, what in (("data.loader=ray_data", "data.loader=ray_data"),
                           ("cluster.fault_tolerance=replicas", "replicas")):
        with pytest.raises(UserError, match=f"train.balance cannot be used with .*{what}"):
            load_config(ROOT / "configs/tiny.yaml", ["train.balance=true", override])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_rebalanced_step_matches_in_half_precision(balanced, precision):
    # Another split sums the same rows' half-precision products in another order: equal up to that
    # rounding (fp16 scales the weighted loss like any other).
    for rank in (0, 1):
        (loss_a, grads_a, _, _), (loss_b, grads_b, _, _) = (
            balanced[rank][("ddp", precision, s)] for s in ((4, 4), (6, 2)))
        assert loss_b == pytest.approx(loss_a, abs=2e-2)
        # The first step's gradient: later ones start from weights that already differ by that rounding.
        for key, value in grads_a[0].items():
            assert abs(grads_b[0][key] - value).max() <= 5e-2 * max(abs(value).max(), 1e-6), (precision, key)
