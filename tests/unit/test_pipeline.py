"""Pipeline parallelism computes what a single process computes, alone and composed with ddp, fsdp and tp;
an fp16 overflow on one stage skips the step on every stage; bad layouts are one clear sentence."""

import pytest

from cs3ray.config import load_config
from cs3ray.core.mesh import Topology
from cs3ray.core.pipeline import split_stage, stage_layers
from cs3ray.errors import UserError
from cs3ray.models.factory import model_from_config

from helpers.core import MODEL, global_batches, run_core, run_distributed
from helpers.pipeline_checkpoints import core_for, pp2_round_trip, resume, save, train

STEPS = 5
LAYERS = ["model.n_layers=4"]  # 2 per stage, or 1 per stage of the interleaved schedule's 4
PP = LAYERS + ["parallel.pp=2", "parallel.pp_microbatches=4"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@pytest.fixture(scope="module")
def batches():
    return global_batches(STEPS, rows=8)


@pytest.fixture(scope="module")
def single(batches):
    return {prec: run_core(LAYERS + [f"precision={prec}"], 0, 1, batches) for prec in ("fp32", "bf16")}


@pytest.fixture(scope="module")
def two_ranks(batches):
    jobs = [(f"{s}-fp32", PP + [f"parallel.pp_schedule={s}", "precision=fp32"]) for s in SCHEDULES]
    jobs += [("interleaved_1f1b-bf16", PP + ["parallel.pp_schedule=interleaved_1f1b", "precision=bf16"]),
             # The first stage's gradients overflow on the 3rd step; the last stage's stay finite.
             ("1f1b-fp16", PP + ["precision=fp16"], {"inject_inf_at": 2, "inject_rank": 0})]
    return run_distributed(jobs, batches, world=2)


@pytest.fixture(scope="module")
def four_ranks(batches):
    jobs = [("pp-ddp", PP + ["precision=fp32"]), ("pp-fsdp", PP + ["precision=fp32", "parallel.strategy=fsdp"]),
            ("pp-zero1", PP + ["precision=fp32", "parallel.strategy=zero1"]),
            ("pp-tp", PP + ["precision=fp32", "parallel.tp=2"]),
            ("interleaved-fsdp", PP + ["precision=fp32", "parallel.strategy=fsdp",
                                       "parallel.pp_schedule=interleaved_1f1b"]),
            # 4 stages: middle stages neither read tokens nor compute the loss; the tied embedding's group
            # is the first and last stage only.
            ("pp4", LAYERS + ["parallel.pp=4", "parallel.pp_microbatches=4", "precision=fp32"])]
    return run_distributed(jobs, batches, world=4)


def assert_close(got, want, tol):
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) < tol, (got, want)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fp32_pipeline_matches_single_process(single, two_ranks, schedule):
    for rank in ("rank0", "rank1"):  # every stage reports the same mean loss
        assert_close(two_ranks[rank][f"{schedule}-fp32"]["losses"], single["fp32"]["losses"], 1e-5)


def test_bf16_pipeline_matches_within_tolerance(single, two_ranks):
    assert_close(two_ranks["rank0"]["interleaved_1f1b-bf16"]["losses"], single["bf16"]["losses"], 3e-2)
    assert two_ranks["rank1"]["interleaved_1f1b-bf16"]["master_dtypes"] == ["torch.float32"]


def test_each_stage_owns_only_its_parameters_under_their_full_names(single, two_ranks):
    cfg = load_config(None, MODEL + ["model.n_layers=4"])
    names = [{n for n, _ in split_stage(model_from_config(cfg), s, 2).named_parameters()} for s in range(2)]
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in names[0]} == \
        {"tok_emb", "blocks.0", "blocks.1"}
    assert {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in names[1]} == \
        {"blocks.2", "blocks.3", "norm", "output"}
    # The tied embedding is held twice (first and last stage); every other parameter once.
    whole = single["fp32"]["memory"]["param_bytes"]
    for schedule in SCHEDULES:
        staged = sum(two_ranks[r][f"{schedule}-fp32"]["memory"]["param_bytes"] for r in ("rank0", "rank1"))
        assert staged == whole + 264 * 32 * 4, schedule


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(two_ranks):
    for rank in ("rank0", "rank1"):
        r = two_ranks[rank]["1f1b-fp16"]
        assert r["applied"] == [True, True, False], (rank, r["applied"])
        assert r["skipped"] == 1 and r["scale"] == 2.0 ** 15, rank


@pytest.mark.parametrize("layout", ["pp-ddp", "pp-fsdp", "pp-zero1", "pp-tp", "interleaved-fsdp", "pp4"])
def test_pipeline_composes_with_data_and_tensor_parallel(single, four_ranks, layout):
    for rank in ("rank0", "rank1"):
        assert_close(four_ranks[rank][layout]["losses"], single["fp32"]["losses"], 1e-5)


def test_fsdp_shards_each_stage_over_the_data_dimension(four_ranks):
    ddp, fsdp = four_ranks["rank0"]["pp-ddp"]["memory"], four_ranks["rank0"]["pp-fsdp"]["memory"]
    assert fsdp["param_bytes"] <= 0.55 * ddp["param_bytes"]


def test_stage_layers_split_blocks_evenly():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_pipeline_is_the_outer_mesh_dimension_and_tp_groups_stay_on_a_node():
    # 2 nodes x 2 workers, pp=2, tp=2: each node holds one stage's tensor-parallel group.
    nodes = ("a", "a", "b", "b")
    topos = [Topology(r, 4, 2, nodes, pp=2) for r in range(4)]
    assert [(t.pp_rank, t.dp_rank, t.tp_rank) for t in topos] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    for t in topos:
        t.check()


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.workers=3"], "parallel.pp=2 x parallel.tp=1 does not divide cluster.workers=3"),
    (["model.n_layers=1"], "needs at least 2 model.n_layers"),
    (["model.n_layers=3", "parallel.pp_schedule=interleaved_1f1b"], "needs at least 4 model.n_layers"),
    (["parallel.pp_microbatches=3"], "must be a multiple of parallel.pp=2 that divides train.batch_size"),
    (["parallel.pp_microbatches=32"], "must be a multiple of parallel.pp=2 that divides train.batch_size"),
    (["cluster.workers={min: 2, max: 4}"], "needs a fixed cluster.workers"),
    (["cluster.workers=4", "parallel.pp_schedule=interleaved_1f1b"], "interleaved_1f1b with more than one data-"),
])
def test_bad_pipeline_layouts_are_one_sentence(overrides, message):
    with pytest.raises(UserError) as err:
        load_config(None, ["parallel.pp=2", "cluster.workers=2"] + overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_checkpoints_load_across_pipeline_degrees(tmp_path):
    """pp=2 -> pp=1 and pp=1 -> pp=2: the loss continues as if training had never stopped."""
    batches, split = global_batches(5, rows=8), 3
    straight = core_for([], 0, 1)
    want = train(straight, batches)
    first = core_for([], 0, 1)
    train(first, batches[:split])
    save(first, f"{tmp_path}/pp1", split)
    ranks = pp2_round_trip(str(tmp_path), batches, split)  # saves pp2, resumes pp1 at pp=2
    for r in ranks.values():
        assert r["resumed_step"] == split
        assert r["losses"] == pytest.approx(want[split:], abs=1e-5)
    single = core_for([], 0, 1)
    assert resume(single, f"{tmp_path}/pp2") == split
    assert train(single, batches[split:]) == pytest.approx(want[split:], abs=1e-5)
