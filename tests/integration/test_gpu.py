"""On a CUDA device (skipped without one; `.ci/gpu-check` runs them on a GPU machine): training with nccl in bf16
and fp16 under each data-parallel strategy, the built-in serving engine's continuous batching on CUDA, and
`cs3 validate`'s GPU items (MFU of a model sized to the GPU, NVML health, nccl busbw within the node)."""

from __future__ import annotations

import json

import pytest
import torch

from cs3ray.models import PRESETS, Transformer
from cs3ray.models.generate import SamplingParams, generate_ids
from cs3ray.serve.engine import Engine, EngineOptions
from cs3ray.serve.sequence import GenRequest

from conftest import run_cs3

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
EOS = 257


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
