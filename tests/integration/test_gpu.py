"""On a CUDA device (skipped without one; `.ci/gpu-check` runs them on a GPU machine): training with nccl in bf16
and fp16 under each data-parallel strategy, with int8 gradient compression and tensor parallel where 2 GPUs allow,
`cs3 bench train --quick` MFU against the measured CUDA peak, `cs3 generate --device cuda`, the built-in serving
engine's continuous batching and the vLLM engine on CUDA, and `cs3 validate`'s GPU items (MFU of a model sized to
the GPU, NVML health, nccl busbw within the node). Key figures go to the JUnit XML as properties (record_property),
which `.ci/gpu-check` prints in its table."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import openai
import pytest
import torch

from cs3ray.models import PRESETS, Transformer
from cs3ray.models.generate import SamplingParams, generate_ids
from cs3ray.serve.engine import Engine, EngineOptions
from cs3ray.serve.sequence import GenRequest

from conftest import run_cs3
from helpers.serve_checkpoints import make_checkpoint
from helpers.serve_session import serve_running

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
EOS = 257
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 GPUs (a worker holds one; nccl refuses 2 ranks on one GPU); "
                                     f"torch sees {torch.cuda.device_count()}")


def _train(ray_head, run_dir, overrides: list[str]) -> dict:
    """`cs3 train` of the tiny config for 8 steps on GPUs with `overrides`; its summary."""
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", "cluster.use_gpu=true", "train.steps=8",
                    "train.warmup_steps=0", "train.log_every=1", "train.eval_every=8", "checkpoint.every=8",
                    *overrides, "--address", ray_head.address, "--json"], env=ray_head.env(), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["final_val_loss"] < summary["initial_val_loss"], summary
    return summary


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_a_gpu_with_nccl(ray_head, tmp_path, precision, strategy):
    run_dir = tmp_path / "run"
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"precision={precision}",
                    f"parallel.strategy={strategy}", "cluster.use_gpu=true", "cluster.workers=1", "train.steps=8",
                    "train.warmup_steps=0", "train.log_every=1", "train.eval_every=8", "checkpoint.every=8",
                    "--address", ray_head.address, "--json"], env=ray_head.env(), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["final_val_loss"] < summary["initial_val_loss"]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    start = next(e for e in events if e["event"] == "start")
    assert start["precision"] == precision
    assert (run_dir / "step-00000008" / "manifest.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_engine_batches_on_cuda_as_it_generates_alone(dtype):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval().to(device="cuda", dtype=dtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [[EOS] + list(f"def f{i}(x):\n    return x * {i}".encode())[: 4 + 3 * i] for i in range(6)]

    def run(engine: Engine, reqs: list[GenRequest]) -> list[str]:
        events: list[list] = [[] for _ in reqs]
        for i, r in enumerate(reqs):
            r.emit = events[i].append
            engine.submit(r)
        while engine.waiting or engine.running:
            engine.step()
        return ["".join(e.text for e in evs) for evs in events]

    batched = run(Engine(model, EOS, EngineOptions(max_batch=6)), [GenRequest(p, greedy) for p in prompts])
    assert all(batched)
    if dtype == torch.float32:  # low precision may flip a near tie between batched and single kernels
        for p, got in zip(prompts, batched, strict=True):
            ref = generate_ids(model, p, greedy, stop_ids=(EOS,))
            assert got == bytes(t for t in ref if t < 256).decode("utf-8", errors="replace")


def test_bench_train_mfu_against_the_measured_cuda_peak(record_property):
    # Its own cluster, as a user's bench run has (not the session head).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = run_cs3(["bench", "train", "--quick", "--device", "cuda", "--threads", "4", "--json"], env=env, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["device"] == "cuda" and r["card"] == torch.cuda.get_device_name(0), r
    assert r["precision"] in ("bf16", "fp16") and r["peak_flops"] > 1e12  # a measured GPU peak, not a CPU's
    for key in ("mfu", "baseline_mfu"):
        assert 0 < r[key] < 1, (key, r[key], r["peak_flops"])
    record_property("mfu", round(r["mfu"], 4))
    record_property("tokens_per_s", round(r["cs3_tokens_per_s"]))
    record_property("peak_tflops", round(r["peak_flops"] / 1e12, 1))
    record_property("overhead_ratio", round(r["overhead_ratio"], 3))


def test_the_int8_codec_round_trips_on_cuda():
    from cs3ray.core.compress import error_bound, make_codec

    codec = make_codec("int8")
    t = torch.randn(3 * 256 + 17, device="cuda") * torch.logspace(-6, 2, 3 * 256 + 17, device="cuda")
    payload = codec.encode(t)
    assert payload.is_cuda and payload.numel() * payload.element_size() == codec.wire_bytes(t.numel())
    back = codec.decode(payload, t.numel())
    assert back.is_cuda and bool(((back - t).abs() <= error_bound(codec, t)).all())


@TWO_GPUS
def test_training_with_int8_compression_on_nccl(ray_head, tmp_path, record_property):
    summary = _train(ray_head, tmp_path / "run", ["cluster.workers=2", "precision=bf16", "parallel.strategy=ddp",
                                                  "compression.codec=int8"])
    wire = summary["compression"]["wire_ratio"]  # over the 8 steps, the first synced in fp32 (DDP's buckets)
    assert summary["compression"]["codec"] == "int8" and (8 * wire - 1) / 7 <= 0.3, summary
    record_property("wire_ratio", summary["compression"]["wire_ratio"])
    record_property("tokens_per_s", summary["tokens_per_s"])


@TWO_GPUS
def test_tensor_parallel_training_on_gpus(ray_head, tmp_path, record_property):
    summary = _train(ray_head, tmp_path / "run", ["cluster.workers=2", "parallel.tp=2", "precision=bf16"])
    record_property("tokens_per_s", summary["tokens_per_s"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_generate_on_cuda_through_the_cli(tmp_path, dtype):
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    proc = run_cs3(["generate", str(run), "--device", "cuda", "--dtype", dtype, "--prompt", "def ",
                    "--max-tokens", "16", "--temperature", "0"], check=True)
    assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def "), proc.stdout


def test_the_vllm_engine_on_cuda(ray_client, tmp_path, record_property):
    pytest.importorskip("vllm")
    from cs3ray.ops.ports import free_port
    from cs3ray.serve.deploy import deploy, make_spec, shutdown

    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    spec = make_spec(str(run), name="tiny-vllm-cuda", token="gpu-s3cret",
                     overrides={"engine": "vllm", "dtype": "bf16", "num_gpus": 1, "max_batch": 8,
                                "export_dir": str(tmp_path / "exports")})
    with serve_running(free_port()) as port:
        try:
            url = deploy(spec, "127.0.0.1", port)
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="gpu-s3cret", max_retries=0, timeout=120)
            t0 = time.perf_counter()
            out = c.completions.create(model=spec.name, prompt="def main(", max_tokens=32, temperature=0)
            seconds = time.perf_counter() - t0
            assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
            again = c.completions.create(model=spec.name, prompt="def main(", max_tokens=32, temperature=0)
            assert again.choices[0].text == out.choices[0].text  # greedy is deterministic
            with urllib.request.urlopen(f"{url}/healthz", timeout=30) as resp:
                assert json.loads(resp.read())["dtype"] == "bfloat16"  # the precision vLLM runs, on the GPU
            record_property("tokens_per_s", round(out.usage.completion_tokens / seconds, 1))
        finally:
            shutdown(spec.name)


def test_validate_measures_the_gpus(ray_client):
    from cs3ray.bench import validate
    from cs3ray.bench.validate_gpu import gpu_nodes

    gpus = gpu_nodes(ray_client.nodes())
    assert sum(gpus.values()) >= 1, "the head node reports no GPU to Ray"
    level = validate.LEVELS["quick"]
    mfu = validate._gpu_mfu(gpus, level, 0.0)
    assert mfu.status == "pass" and 0 < mfu.figure < 1, mfu
    health = validate._gpu_health(gpus)
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert health.status == "not measured" and "pynvml" in health.detail
    else:
        assert health.status in ("pass", "fail") and health.figure == sum(gpus.values()), health
    extra: dict = {}
    node = validate._nccl_node(gpus, level, extra)
    if max(gpus.values()) < 2:
        assert node.status == "not measured" and "one GPU" in node.detail
    else:
        assert extra["node_busbw_gbps"] > 0 and node.figure is None or node.figure > 0, node  # measured either way
    across = validate._nccl_across(gpus, level, None, extra)
    if len(gpus) < 2:
        assert across.status == "not measured"
