"""`cs3 plan --rehearse`: cs3ray's own step on fake tensors at a world size no test machine has.

The rehearsal runs the real compute core (FSDP2, AdamW, loss scaling, codecs, accumulation) on
64 fake ranks in milliseconds of memory: its model state equals the planner's and a real rank's,
gradients stay sharded under accumulation, the codecs' residuals appear, and what it cannot
rehearse yet is refused in one line.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cs3
from helpers.core import global_batches, run_distributed

SHAPE = ["--layers", "4", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "768", "--vocab", "512",
         "--seq-len", "128"]


def _rehearse(*args: str) -> dict:
    proc = run_cs3(["plan", *SHAPE, "--strategy", "fsdp", "--rehearse", "--json", *args], check=True)
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
@pytest.mark.parametrize("extra", [["--workers", "64", "--global-batch", "256"], ["--workers", "512", "--ac"]])
def test_plan_agrees_with_the_rehearsal_of_70b(extra):
    proc = run_cs3(["plan", "--model", "70b", "--strategy", "fsdp", "--rehearse", "--json", *extra], check=True)
    _agrees_with_the_plan(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("codec", ["int8", "int4_sparse"])
def test_compressed_reduce_scatter_is_rehearsed_with_its_residuals(codec):
    out = _rehearse("--workers", "64", "--precision", "bf16", "--codec", codec)
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


def test_what_is_not_rehearsed_yet_is_refused_in_one_line():
    for extra in (["--strategy", "ddp"], ["--strategy", "fsdp", "--tp", "2"]):
        proc = run_cs3(["plan", *SHAPE, "--workers", "8", "--rehearse", *extra])
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
        assert "--rehearse runs parallel.strategy=fsdp" in lines[0]
