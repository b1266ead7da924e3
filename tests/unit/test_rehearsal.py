"""`cs3 plan --rehearse`: cs3ray's own step on fake tensors at a world size no test machine has.

The rehearsal runs the real compute core (FSDP2, AdamW, loss scaling, codecs, accumulation) on
64 fake ranks in milliseconds of memory, for ddp, zero1 and fsdp with and without tensor and
pipeline parallelism: its model state equals the planner's and a real rank's, gradients stay sharded
under accumulation, the codecs' residuals and buffers appear in the peak.
"""

from __future__ import annotations

import json

import pytest

from cs3ray.ops.planner import SHAPES

from conftest import run_cs3
from helpers.core import global_batches, run_distributed

SHAPE = ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "768", "--vocab", "512",
         "--seq-len", "128"]


def _rehearse(*args: str) -> dict:
    strategy = [] if "--strategy" in args else ["--strategy", "fsdp"]
    proc = run_cs3(["plan", *SHAPE, *strategy, "--rehearse", "--json", *args], check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _agrees_with_the_plan(out: dict) -> None:
    """The planner's formulas against the rehearsal, key by key: model state within 2%, activations
    and the peak within 10%, bytes sent per step within 2%."""
    got, planned = out["per_worker"], out["plan"]["per_worker"]
    assert set(planned) <= set(got)
    for key, tolerance in (("param_bytes", 0.02), ("optimizer_bytes", 0.02), ("model_state_bytes", 0.02),
                           ("gather_bytes", 0.02), ("activation_bytes", 0.1), ("total_bytes", 0.1)):
        assert planned[key] == pytest.approx(got[key], rel=tolerance), (key, planned[key], got[key])
    assert out["plan"]["comm_bytes_per_step"] == pytest.approx(out["comm_bytes_per_step"], rel=0.02)


@pytest.mark.parametrize("precision, ac", [("fp32", False), ("bf16", False), ("fp16", True)])
def test_plan_agrees_with_the_rehearsal_and_gradients_stay_sharded_under_accumulation(precision, ac):
    extra = ["--precision", precision, "--micro-batch", "2", *(["--ac"] if ac else [])]
    one = _rehearse("--workers", "64", *extra)
    four = _rehearse("--workers", "64", *extra, "--global-batch", "512")
    for out in (one, four):
        _agrees_with_the_plan(out)
        got = out["per_worker"]
        # FSDP's gradients: this rank's shard, P x 4 / N, after 1 or 4 micro-batches alike.
        assert got["grad_bytes"] == got["param_bytes"]
        assert 0 < got["activation_bytes"] <= got["total_bytes"]
    # Four micro-batches: four reduce-scatters of the gradients, the same memory for them.
    scatter = {n: out["comm_bytes_by_op"]["_reduce_scatter_base_"] for n, out in (("one", one), ("four", four))}
    assert scatter["four"] == 4 * scatter["one"]


@pytest.mark.slow
# 4 pipeline stages of 4 micro-batches at 64 workers; accumulation, tp 8 and zero1 at 70B are in
# docs/benchmarks.md's table (their small shapes run in the fast cases here, four micro-batches among them:
# every micro-batch after the first accumulates alike, and each costs the 70B shape's every block twice).
@pytest.mark.parametrize("extra", [["--workers", "64", "--pp", "4", "--micro-batch", "4"]])
def test_plan_agrees_with_the_rehearsal_of_70b(extra):
    proc = run_cs3(["plan", "--model", "70b", "--strategy", "fsdp", "--rehearse", "--json", *extra], check=True)
    _agrees_with_the_plan(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("codec", ["int8", "int4_sparse"])
def test_compressed_reduce_scatter_is_rehearsed_with_its_residuals(codec):
    out = _rehearse("--workers", "16", "--precision", "bf16", "--codec", codec)
    _agrees_with_the_plan(out)  # the peak counts the exchange's kept buffers
    assert out["per_worker"]["residual_bytes"] > 0
    assert out["comm_bytes_by_op"].get("send", 0) > 0  # cs3ray's point-to-point exchange, not torch's collective
    assert out["per_worker"]["residual_bytes"] == pytest.approx(out["plan"]["per_worker"]["residual_bytes"], rel=0.05)


def test_layers_extended_from_two_rehearsals_match_rehearsing_them_all():
    def rehearsal(*extra: str) -> dict:
        proc = run_cs3(["plan", "--layers", "6", *SHAPE[2:], "--strategy", "fsdp", "--workers", "16", "--precision",
                        "bf16", "--rehearse", "--json", *extra], check=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    scaled, full = rehearsal("--rehearse-layers", "2"), rehearsal()
    assert scaled["layers_rehearsed"] == [2, 4] and full["layers_rehearsed"] == [6]
    for key in ("model_state_bytes", "activation_bytes", "total_bytes"):
        assert scaled["per_worker"][key] == pytest.approx(full["per_worker"][key], rel=0.05), key
    assert scaled["comm_bytes_per_step"] == pytest.approx(full["comm_bytes_per_step"], rel=0.05)


def test_rehearsed_model_state_equals_what_real_ranks_hold():
    out = _rehearse("--workers", "2", "--precision", "fp32")
    dims = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=768",
            "model.vocab_size=512", "model.max_seq_len=128", "model.tie_embeddings=false", "train.seq_len=16",
            "parallel.strategy=fsdp", "precision=fp32"]
    real = run_distributed([("fsdp", dims)], global_batches(1, rows=4), world=2)["rank0"]["fsdp"]["memory"]
    got = out["per_worker"]
    assert (got["param_bytes"], got["optimizer_bytes"]) == (real["param_bytes"], real["optim_bytes"])


@pytest.mark.parametrize("extra", [
    ["--strategy", "ddp", "--workers", "16", "--precision", "bf16"],
    ["--strategy", "zero1", "--workers", "16", "--precision", "fp16", "--ac"],
    # Four micro-batches: DDP's gradients stay in its buckets (no second copy under no_sync).
    ["--strategy", "ddp", "--workers", "16", "--precision", "fp32", "--micro-batch", "2", "--global-batch", "128"],
    ["--strategy", "zero1", "--workers", "2", "--tp", "2", "--precision", "bf16", "--micro-batch", "2",
     "--global-batch", "8"],
    ["--strategy", "fsdp", "--workers", "16", "--tp", "2", "--precision", "fp32", "--ac"],
    # Pipelines: the first stage, 1f1b over pp micro-batches.
    ["--strategy", "fsdp", "--workers", "8", "--pp", "2", "--micro-batch", "4", "--precision", "bf16"],
    ["--strategy", "ddp", "--workers", "4", "--pp", "2", "--micro-batch", "4", "--precision", "fp16"],
    ["--strategy", "zero1", "--workers", "8", "--pp", "4", "--micro-batch", "4", "--precision", "fp32"],
])
def test_ddp_zero1_and_tensor_parallel_rehearsals_agree_with_the_plan(extra):
    _agrees_with_the_plan(_rehearse(*extra))


def test_tensor_parallel_sends_two_all_reduces_a_block_each_way():
    # One backward all-reduce for q, k and v together (and one for w1 and w3), as Megatron does.
    out = _rehearse("--strategy", "fsdp", "--workers", "8", "--tp", "2", "--precision", "bf16")
    tokens, hidden, blocks = 128, 256, 4
    per_all_reduce = 2 * (2 - 1) / 2 * tokens * hidden * 2
    assert out["comm_bytes_by_op"]["all_reduce"] == blocks * 4 * per_all_reduce


@pytest.mark.parametrize("strategy, precision", [("ddp", "bf16"), ("zero1", "fp16")])
def test_the_compressed_all_reduce_is_rehearsed_with_its_residuals(strategy, precision):
    # fp16 keeps a spare residual buffer (a skipped step's residuals are dropped, the kept ones untouched).
    out = _rehearse("--strategy", strategy, "--workers", "16", "--precision", precision, "--codec", "int8")
    _agrees_with_the_plan(out)
    got, planned = out["per_worker"], out["plan"]["per_worker"]
    assert got["residual_bytes"] == pytest.approx(planned["residual_bytes"], rel=0.02) and got["residual_bytes"] > 0
    assert got["model_state_bytes"] == pytest.approx(planned["model_state_bytes"], rel=0.02)
    # cs3ray's point-to-point exchange carries the gradients; an all-reduce only fp16's overflow flag.
    assert out["comm_bytes_by_op"]["send"] > 0 and out["comm_bytes_by_op"].get("allreduce_", 0) <= 8
    assert out["comm_bytes_per_step"] == pytest.approx(out["plan"]["comm_bytes_per_step"], rel=0.02)


def test_zero1_partitions_whole_parameters_so_the_embedding_sets_its_share():
    # 70B over 512 ranks: P/N is 0.14 B parameters, the embedding alone 0.26 B; rank 0 holds it.
    plan = json.loads(run_cs3(["plan", "--model", "70b", "--strategy", "zero1", "--workers", "512", "--json"],
                              check=True).stdout)
    a = SHAPES["70b"]
    assert a.vocab_size * a.dim > plan["params"] / 512
    assert plan["per_worker"]["optimizer_bytes"] == a.vocab_size * a.dim * 8


def test_pipeline_stages_reduce_scatter_every_micro_batch_unless_asked():
    # torch's schedule holds a stage's whole fp32 gradient and gathered parameters until the step ends;
    # cs3ray reduce-scatters each pipeline micro-batch's gradients, as outside pipelines.
    args = ["--strategy", "fsdp", "--workers", "8", "--pp", "2", "--micro-batch", "4", "--precision", "bf16"]
    sharded, held = _rehearse(*args), _rehearse(*args, "--unsharded-accumulation")
    for out in (sharded, held):
        assert out["comm_bytes_per_step"] == pytest.approx(out["plan"]["comm_bytes_per_step"], rel=0.02)
    scatter = {name: out["comm_bytes_by_op"]["_reduce_scatter_base_"] for name, out in (("sharded", sharded),
                                                                                         ("held", held))}
    assert scatter["sharded"] == 2 * scatter["held"]  # two pipeline micro-batches, one reduce-scatter each
    assert sharded["per_worker"]["total_bytes"] < held["per_worker"]["total_bytes"]
    _agrees_with_the_plan(sharded)


def test_a_pipeline_micro_batch_that_does_not_split_is_refused_in_one_line():
    proc = run_cs3(["plan", *SHAPE, "--workers", "8", "--pp", "2", "--rehearse"])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert "--micro-batch a multiple of 2" in lines[0]


def test_the_interleaved_schedule_is_rehearsed_from_a_job_config(tmp_path):
    # Rank 0 holds stages 0 and 2 of 4: it sends stage 0's activations, stage 2's activations and stage 2's
    # input gradients (3x 1f1b's sends), and holds torch's warm-up forwards of half-stages at once.
    config = tmp_path / "job.yaml"
    out = {}
    for schedule in ("1f1b", "interleaved_1f1b"):
        config.write_text("model: {preset: tiny}\nprecision: bf16\ncluster: {workers: 4}\n"
                          "train: {batch_size: 8, seq_len: 64}\n"
                          f"parallel: {{strategy: fsdp, pp: 2, pp_schedule: {schedule}, pp_microbatches: 4}}\n")
        proc = run_cs3(["plan", "--rehearse", "--config", str(config), "--json"], check=True)
        out[schedule] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, interleaved = out["1f1b"], out["interleaved_1f1b"]
    assert interleaved["per_worker"]["model_state_bytes"] == plain["per_worker"]["model_state_bytes"]
    assert interleaved["comm_bytes_by_op"]["send"] == 3 * plain["comm_bytes_by_op"]["send"]
    assert interleaved["per_worker"]["activation_bytes"] > plain["per_worker"]["activation_bytes"] > 0
