"""`cs3 plan`: figures for known shapes equal hand-computed values, the ZeRO-3 model-state formula of DeepSpeed's
estimator is reproduced as the peer, predictions are within 15% of the tensor bytes real ranks hold, and the CLI
prints one JSON object last, or one line for bad input."""

from __future__ import annotations

import json

import pytest

from cs3ray.errors import UserError
from cs3ray.ops.planner import SHAPES, PlanInput, per_worker, plan, scenario_notes, shape

from conftest import run_cs3
from helpers.core import global_batches, run_distributed

P7B = 6_738_415_616  # Llama-2-7B's published parameter count


def test_known_shapes_have_their_published_parameter_counts():
    assert shape("7b")[1] == P7B
    assert round(shape("70b")[1] / 1e9, 1) == 69.0 and round(shape("400b")[1] / 1e9) == 406
    assert round(shape("24t")[1] / 1e12, 1) == 24.0


# ZeRO-1 hands out whole parameters (largest first, to the least loaded rank): a share a little over P/N.
@pytest.mark.parametrize("strategy, state, rel", [("ddp", 16 * P7B, 0), ("zero1", 8 * P7B + 8 * P7B // 8, 0.01),
                                                  ("fsdp", 16 * P7B // 8, 0)])
def test_model_state_per_worker_by_strategy(strategy, state, rel):
    r = plan(PlanInput(*shape("7b"), strategy=strategy, workers=8))
    w = r.per_worker
    assert w.model_state_bytes == pytest.approx(state, abs=4, rel=rel)
    assert w.model_state_bytes == w.param_bytes + w.grad_bytes + w.optimizer_bytes
    assert r.checkpoint_bytes == 12 * P7B  # fp32 weights and both AdamW moments
    # An fp32 ring all-reduce: 2 (n-1)/n x 4 bytes a parameter (ddp); zero1 adds the parameter broadcast.
    ring = 2 * 7 / 8 * 4 * P7B
    # fsdp: bf16 parameters gathered in forward and in backward (but for the root and the last block, which
    # stay gathered in between), fp32 gradients reduce-scattered.
    args = shape("7b")[0]
    kept = P7B - 31 * (P7B - 2 * args.vocab_size * args.dim - args.dim) // 32
    fsdp = 7 / 8 * (2 * (2 * P7B - kept) + 4 * P7B)
    assert r.comm_bytes_per_step_uncompressed == pytest.approx(ring + (7 / 8 * 4 * P7B if strategy == "zero1" else 0)
                                                               if strategy != "fsdp" else fsdp, rel=1e-6)


def test_tensor_parallel_codecs_and_time():
    args, n = shape("7b")
    base = plan(PlanInput(args, n, strategy="ddp", workers=16, tp=2, mfu=0.5, tflops=100.0, global_batch=64,
                          seq_len=2048, tokens=1e12))
    # Tensor parallelism splits the blocks' projections; the embedding, the output layer and the norms stay whole.
    whole = 2 * args.vocab_size * args.dim + (2 * args.n_layers + 1) * args.dim
    shard = (n - whole) / 2 + whole
    assert base.per_worker.param_bytes == pytest.approx(4 * shard, abs=4)
    int8 = plan(PlanInput(args, n, strategy="ddp", workers=16, tp=2, codec="int8", global_batch=64, seq_len=2048))
    sparse = plan(PlanInput(args, n, strategy="ddp", workers=16, tp=2, codec="int4_sparse", global_batch=64, seq_len=2048))
    dp_bytes = 2 * 7 / 8 * 4 * shard
    tp_bytes = base.comm_bytes_per_step_uncompressed - dp_bytes
    assert (int8.comm_bytes_per_step - tp_bytes) / dp_bytes == pytest.approx(0.25, abs=0.01)
    assert (sparse.comm_bytes_per_step - tp_bytes) / dp_bytes <= 0.0625
    assert int8.per_worker.residual_bytes == pytest.approx(4 * shard, rel=1e-6)
    # Time: tokens x FLOPs a token / (workers x peak x MFU).
    assert base.tokens_per_step == 64 * 2048
    assert base.step_time_s == pytest.approx(64 * 2048 * base.flops_per_token / (16 * 100e12 * 0.5))
    assert base.days_to_train == pytest.approx(1e12 / base.tokens_per_s / 86400)


def test_fewest_workers_that_fit():
    args, n = shape("70b")
    p = PlanInput(args, n, strategy="fsdp", activation_checkpointing=True, seq_len=2048, device_mem_gb=80)
    fit = plan(p).min_workers_to_fit
    assert fit is not None and per_worker(p, fit).total_bytes <= 80e9 < per_worker(p, fit - 1).total_bytes
    assert plan(PlanInput(args, n, strategy="ddp")).min_workers_to_fit is None  # 1.1 TB of state on every worker


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, gpus: int) -> int:
    """DeepSpeed's estimate_zero3_model_states_mem_needs, the case estimate_..._all_cold lists without offload:
    4 bytes for the largest layer's gathered fp16 parameters and gradients, plus 18 bytes a parameter over the
    GPUs (fp16 parameter shard 2, fp32 master 4, Adam moments 8, fp32 gradient 4)."""
    return 4 * largest_layer_params + int(18 * total_params / gpus)


@pytest.mark.parametrize("model, gpus", [("7b", 8), ("70b", 64), ("400b", 512)])
def test_zero3_model_state_matches_deepspeeds_estimator_less_its_fp16_parameter_copy(model, gpus):
    args, n = shape(model)
    largest = max(args.vocab_size * args.dim, args.dim * args.ffn_dim)  # one module's own parameters
    ds = deepspeed_zero3_gpu_bytes(n, largest, gpus)
    mine = plan(PlanInput(args, n, strategy="fsdp", workers=gpus, precision="bf16")).per_worker
    # cs3ray keeps no 16-bit copy of its parameter shard (autocast over fp32 masters): 16 bytes, not 18.
    assert mine.model_state_bytes == pytest.approx(ds - 4 * largest - 2 * n / gpus, rel=1e-9)


def test_scenarios_say_what_the_published_figures_can_be():
    notes = " ".join(scenario_notes("24t-2048"))
    assert "384 TB" in notes and "'480 TB' is 20 bytes a parameter" in notes and "not the checkpoint" in notes
    assert "more than any single accelerator holds" in notes
    notes = " ".join(scenario_notes("70b-24h"))
    assert "1.4 T tokens" in notes and "accelerators at 989 TF" in notes


SIZES = {"tiny": ["model.dim=192", "model.n_layers=4", "model.n_heads=6", "model.ffn_dim=512", "model.vocab_size=264"],
         "small": ["model.dim=768", "model.n_layers=8", "model.n_heads=12", "model.ffn_dim=2048", "model.vocab_size=264"]}


def test_predictions_within_15_percent_of_the_bytes_real_ranks_hold():
    jobs = [(f"{m}-{s}", [*dims, "model.max_seq_len=32", f"parallel.strategy={s}", "precision=fp32"])
            for m, dims in SIZES.items() for s in ("ddp", "zero1", "fsdp")]
    measured = run_distributed(jobs, global_batches(2, rows=4), world=2)
    for name, _ in [(j[0], j) for j in jobs]:
        model, strategy = name.split("-")
        args, n = shape(model)
        predicted = plan(PlanInput(args, n, strategy=strategy, workers=2, precision="fp32")).per_worker
        for rank in ("rank0", "rank1"):
            got = measured[rank][name]["memory"]
            real = got["param_bytes"] + got["grad_bytes"] + got["optim_bytes"]
            assert predicted.model_state_bytes == pytest.approx(real, rel=0.15), (name, rank, got)


def test_cli_json_and_bad_input():
    proc = run_cs3(["plan", "--model", "7b", "--workers", "8", "--strategy", "zero1", "--tokens", "1e12", "--json"],
                   check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "activation_bytes"} <= out["per_worker"].keys()
    for key in ("min_workers_to_fit", "checkpoint_bytes", "comm_bytes_per_step", "step_time_s", "tokens_per_s",
                "days_to_train"):
        assert key in out
    assert out["per_worker"]["model_state_bytes"] == pytest.approx(8 * P7B + P7B, rel=0.01)  # ZeRO's whole parameters
    proc = run_cs3(["plan", "--model", "7b", "--layers", "4"])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and "either --model or --params" in lines[0], proc.stderr
    for call, message in ((lambda: shape("9b"), "unknown model '9b'"),
                          (lambda: shape(None, None, layers=2, hidden=100, heads=3), "not a multiple of --heads"),
                          (lambda: plan(PlanInput(*shape("7b"), workers=3, tp=2)), "not a multiple of --tp")):
        with pytest.raises(UserError, match=message):
            call()


def test_shape_from_sizes():
    args, n = shape(None, None, layers=2, hidden=256)
    assert args.n_heads == 2 and args.ffn_dim == 768 and n > 0
    with pytest.raises(UserError, match="give --model, or --layers and --hidden"):
        shape(None, 10**9)
    assert SHAPES["24t"].n_layers == 542


def test_fsdp_accumulation_keeps_gradients_sharded_unless_asked_and_prints_the_cost():
    args, n = shape("70b")
    sharded = plan(PlanInput(args, n, strategy="fsdp", workers=64, micro_batch=1, global_batch=256))
    held = plan(PlanInput(args, n, strategy="fsdp", workers=64, micro_batch=1, global_batch=256,
                          unsharded_accumulation=True))
    assert sharded.per_worker.grad_bytes == int(4 * n / 64)  # P x 4 / N
    assert held.per_worker.grad_bytes - sharded.per_worker.grad_bytes == pytest.approx(4 * n, rel=1e-6)
    # 4 reduce-scatters of fp32 gradients a step instead of 1: 3 x (N-1)/N x 4P more bytes.
    assert sharded.comm_bytes_per_step - held.comm_bytes_per_step == pytest.approx(3 * 63 / 64 * 4 * n, rel=1e-6)
    assert any("parallel.fsdp_unsharded_accumulation" in note and "275.9" in note for note in sharded.notes)


def test_a_global_batch_smaller_than_the_data_parallel_width_is_refused_and_scenarios_pick_a_feasible_one():
    args, n = shape("70b")
    with pytest.raises(UserError, match="cannot feed 64 data-parallel workers"):
        plan(PlanInput(args, n, workers=64, global_batch=32))
    with pytest.raises(UserError, match="use a multiple of 64"):
        plan(PlanInput(args, n, workers=64, global_batch=100))
    proc = run_cs3(["plan", "--scenario", "70b-24h", "--json"], check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["workers"] == 18432 and out["tokens_per_step"] == 18432 * 4096
    assert any("cannot feed 18,432 data-parallel workers" in note and "1,024 workers" in note for note in out["notes"])
    refused = run_cs3(["plan", "--model", "70b", "--workers", "64", "--global-batch", "32"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and "cannot feed 64" in refused.stderr


def test_pipeline_stages_hold_their_share_of_the_blocks():
    args, n = shape("70b")
    flat = plan(PlanInput(args, n, strategy="zero1", tp=8, workers=64, seq_len=4096))
    piped = plan(PlanInput(args, n, strategy="zero1", tp=8, pp=4, workers=64, seq_len=4096))
    # A stage: 20 of the 80 blocks over the same tp, and the embedding (or the output layer) whole.
    stage = 20 * (n - 2 * args.vocab_size * args.dim) / 80 / 8 + args.vocab_size * args.dim
    assert piped.per_worker.param_bytes == pytest.approx(4 * stage, rel=1e-3)
    assert piped.per_worker.param_bytes < flat.per_worker.param_bytes / 3
    # 1f1b: the first stage holds pp micro-batches of micro_batch / pp sequences, for a quarter of the blocks.
    assert piped.per_worker.activation_bytes < flat.per_worker.activation_bytes
    assert piped.pp == 4 and piped.comm_bytes_per_step > 0
    with pytest.raises(UserError, match="multiple of --tp x --pp"):
        plan(PlanInput(args, n, tp=8, pp=4, workers=48))
    with pytest.raises(UserError, match="more stages than"):
        plan(PlanInput(*shape("7b"), pp=64, workers=64))
