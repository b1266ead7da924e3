"""`cs3 bench train --device`: the choice reaches every mode (the plain loop, the Ray Train peer, cs3ray's runs and
the peak), and a GPU that is not there is one sentence. torch.cuda is patched only to play a host with a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cs3ray.bench import train as train_bench
from cs3ray.bench.plain_loop import plain_loop, ray_train_scaling
from cs3ray.config import load_config
from cs3ray.core import peak
from cs3ray.errors import UserError
from cs3ray_cli.main import app


def _one_line(output: str) -> str:
    assert "Traceback" not in output
    return " ".join(output.split())


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def captured(monkeypatch):
    """train_bench.run replaced by a recorder that stops the command once it has been called."""
    calls: list[dict] = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        raise UserError("stopped here")
    monkeypatch.setattr(train_bench, "run", record)
    return calls


def test_device_cuda_without_a_gpu_is_one_sentence_and_exit_2(no_cuda, captured):
    res = CliRunner().invoke(app, ["bench", "train", "--quick", "--device", "cuda", "--json"])
    assert res.exit_code == 2 and "--device cuda: torch sees no CUDA device here" in _one_line(res.output)
    assert not captured  # refused before any work
    bad = CliRunner().invoke(app, ["bench", "train", "--quick", "--device", "tpu"])
    assert bad.exit_code == 2 and "unknown --device 'tpu': use auto, cpu or cuda." in _one_line(bad.output)


def test_the_device_reaches_the_bench(monkeypatch, captured):
    runner = CliRunner()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags in ([], ["--device", "cpu"], ["--device", "auto"]):
        assert runner.invoke(app, ["bench", "train", "--quick", *flags]).exit_code == 2
    assert [c["device"] for c in captured] == ["cpu", "cpu", "cpu"]  # the default stays the CPU; auto finds no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for flags in (["--device", "auto"], ["--device", "cuda"], []):
        assert runner.invoke(app, ["bench", "train", "--quick", *flags]).exit_code == 2
    assert [c["device"] for c in captured[3:]] == ["cuda", "cuda", "cpu"]


def test_run_refuses_cuda_without_gpus_and_pipelines_on_one_gpu(monkeypatch):
    monkeypatch.setattr(train_bench, "gpu_count", lambda: 0)
    with pytest.raises(UserError, match="--device cuda: torch sees no CUDA device"):
        train_bench.run(quick=True, device="cuda", log=lambda _: None)
    monkeypatch.setattr(train_bench, "gpu_count", lambda: 1)
    with pytest.raises(UserError, match="--pipelines --device cuda needs 2 GPUs"):
        train_bench.run(quick=True, device="cuda", pipelines=True, log=lambda _: None)
    with pytest.raises(UserError, match="unknown device 'xla'"):
        train_bench.run(quick=True, device="xla", log=lambda _: None)


def test_cs3ray_runs_and_the_ray_train_peer_take_a_gpu_on_cuda():
    gpu, cpu = train_bench.run_overrides(8, "cuda"), train_bench.run_overrides(8, "cpu")
    assert "cluster.use_gpu=true" in gpu and gpu[:-1] == cpu  # the same runs otherwise
    assert load_config("configs/tiny.yaml", gpu).cluster.use_gpu  # a valid config: nccl, one GPU a worker
    assert not load_config("configs/tiny.yaml", cpu).cluster.use_gpu
    scaling = ray_train_scaling(4, "cuda")
    assert scaling.use_gpu and scaling.num_workers == 1 and scaling.num_gpus_per_worker == 1
    assert scaling.num_cpus_per_worker == 4
    on_cpu = ray_train_scaling(4, "cpu")
    assert not on_cpu.use_gpu and on_cpu.num_gpus_per_worker == 0 and on_cpu.num_cpus_per_worker == 4


def test_a_cuda_peak_is_timed_on_the_gpu_with_products_that_fill_it(monkeypatch):
    asked: list[tuple] = []
    monkeypatch.setattr(peak, "_cuda_peak", lambda *args: asked.append(args) or 1e15)
    assert peak.measure_peak(torch.bfloat16, 16, size=1024, seconds=0.5, device="cuda") == 1e15
    dtype, size, seconds, device = asked[0]
    assert dtype == torch.bfloat16 and size == peak.CUDA_SIZE and seconds == 0.5 and device.type == "cuda"
    assert peak.measure_peak(torch.float32, 1, size=64, seconds=0.05, device="cpu") > 0 and len(asked) == 1


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_plain_loop_steps_on_the_device_it_is_given(precision):
    cfg = load_config("configs/tiny.yaml", [f"precision={precision}", "train.batch_size=2", "train.seq_len=16"])
    batches = np.random.default_rng(0).integers(0, 256, (8, 17), dtype=np.int64)
    times = plain_loop(cfg, batches, 1, 2, torch.device("cpu"))  # fp16: through GradScaler, as on a GPU
    assert len(times) == 2 and all(t > 0 for t in times)
