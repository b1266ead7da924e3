"""`cs3 plan --serve`: serving layouts' memory and their bandwidth-bound decode rate, checked by hand."""

import json

import pytest

from cs3ray.errors import UserError
from cs3ray.models.args import ModelArgs
from cs3ray.models.presets import PRESETS
from cs3ray.ops.serve_planner import ServeInput, kv_bytes_per_token, plan_serving

from conftest import run_cs3

GB = 1e9
# Small enough to count by hand: 4 blocks of width 1024, 8 heads of 128, 2 key/value heads.
SMALL = ModelArgs(dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=4096, vocab_size=1000, max_seq_len=2048,
                  tie_embeddings=False)


def test_kv_cache_bytes_per_token_follow_the_key_value_heads():
    # 70B: 80 layers x 8 kv heads x 128 x (key + value) x 2 bytes.
    assert kv_bytes_per_token(PRESETS["70b"], 2.0) == 80 * 8 * 128 * 2 * 2
    # Split by tp while there are heads to split, copied beyond: tp 8 over 2 kv heads keeps one a GPU.
    assert kv_bytes_per_token(SMALL, 2.0, tp=2) == kv_bytes_per_token(SMALL, 2.0) / 2
    assert kv_bytes_per_token(SMALL, 2.0, tp=8) == kv_bytes_per_token(SMALL, 2.0) / 2
    assert kv_bytes_per_token(SMALL, 2.0, pp=2) == kv_bytes_per_token(SMALL, 2.0) / 2


def test_a_given_concurrency_decodes_at_the_bandwidth_bound():
    s = ServeInput(SMALL, gpus_per_node=2, max_nodes=1, device_mem_gb=80, hbm_tbs=1.0, context=1000, concurrency=64)
    layouts = {(x.tp, x.pp): x for x in plan_serving(s).layouts}
    x = layouts[(2, 1)]
    blocks = 4 * ((2 * 1024 * 8 * 128 + 3 * 1024 * 4096) / 2 + 2 * 1024 * 1 * 128 + 2 * 1024)
    weights = (blocks + 2 * 1000 * 1024 / 2) * 2  # + embedding and output projection, vocabulary-split
    assert x.weight_bytes_per_gpu == pytest.approx(weights)
    per_seq = 2 * 4 * 1 * 128 * 2 * 1000
    assert x.kv_bytes_per_sequence_per_gpu == pytest.approx(per_seq)
    itl = (weights + 64 * per_seq) / 1e12
    assert x.bound == "memory" and x.itl_ms == pytest.approx(itl * 1000)
    assert x.tokens_per_s == pytest.approx(64 / itl)
    # Two stages: each stage reads its weights once per micro-batch, so a round reads 2 x its weights.
    y = layouts[(1, 2)]
    assert y.itl_ms == pytest.approx((2 * y.weight_bytes_per_gpu + 64 * y.kv_bytes_per_sequence_per_gpu) / 1e12 * 1000)


def test_the_chosen_concurrency_is_the_most_within_the_latency_and_memory():
    s = ServeInput(PRESETS["70b"], context=4096, itl_ms=30.0)
    for x in plan_serving(s).layouts:
        if not x.fits:
            continue
        assert x.itl_ms <= 30.0 + 1e-9 and x.sequences <= x.max_sequences
        one_more = (x.pp * x.weight_bytes_per_gpu + (x.sequences + 1) * x.kv_bytes_per_sequence_per_gpu) \
            / (s.hbm_tbs * 1e12) * 1000
        assert x.sequences == x.max_sequences or one_more > 30.0


def test_400b_needs_a_full_node_per_stage_and_two_stages_at_least():
    r = plan_serving(ServeInput(PRESETS["400b"]))
    fitting = {(x.tp, x.pp) for x in r.layouts if x.fits}
    assert fitting and all(tp == 8 and pp >= 2 for tp, pp in fitting)
    eight = next(x for x in r.layouts if (x.tp, x.pp) == (8, 1))
    assert not eight.fits and "weights alone" in eight.note  # 812 GB over 8 GPUs of 72 usable GB
    assert r.seeds_layout is not None and r.gpus_for_seeds_rate == r.replicas_for_seeds_rate * r.seeds_layout.gpus
    assert r.seeds_layout.tokens_per_s * r.replicas_for_seeds_rate >= 2522


def test_few_flops_make_the_round_compute_bound():
    r = plan_serving(ServeInput(SMALL, gpus_per_node=1, max_nodes=1, tflops=0.001, concurrency=8))
    x = r.layouts[0]
    assert x.bound == "compute" and x.itl_ms > 1000


def test_bad_serving_input_is_one_line():
    with pytest.raises(UserError, match="kv-dtype"):
        plan_serving(ServeInput(SMALL, kv_dtype="fp4"))
    proc = run_cs3(["plan", "--serve", "--model", "400b", "--weight-dtype", "fp4"])
    assert proc.returncode == 2 and "weight-dtype 'fp4'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cs3(["plan", "--serve", "--model", "70b", "--scenario", "70b-24h"])
    assert proc.returncode == 2 and "--serve" in proc.stderr


def test_cli_json_names_the_layouts_and_the_seeds_figure():
    proc = run_cs3(["plan", "--serve", "--model", "400b", "--gpus-per-node", "8", "--json"], check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["seeds_tokens_per_s"] == 2522 and r["best"]["tp"] == 8 and r["best"]["fits"]
    assert {"tp", "pp", "weight_bytes_per_gpu", "kv_bytes_per_gpu", "itl_ms", "tokens_per_s"} <= set(r["layouts"][0])
    assert "2,522 tokens/s" in proc.stderr
