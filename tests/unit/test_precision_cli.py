"""`cs3 generate --dtype` and `cs3 ckpt export --dtype` in every precision, bad values refused (no Ray)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cs3ray.config import load_config
from cs3ray.models import Transformer
from cs3ray_cli import generate_cmd
from cs3ray_cli.main import app

from helpers.serve_checkpoints import ROOT, make_checkpoint

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny checkpoint trained (as its config says) in fp16, whose serve section asks for bf16."""
    run_dir = tmp_path_factory.mktemp("precision") / "run"
    make_checkpoint(run_dir, step=3, overrides=["precision=fp16", "serve.dtype=bf16"])
    return run_dir


@pytest.mark.parametrize("precision", [*PRECISIONS, None])
def test_generate_runs_in_the_asked_precision(run, precision, monkeypatch):
    seen = []
    real = generate_cmd.generate_text
    monkeypatch.setattr(generate_cmd, "generate_text",
                        lambda model, *rest: (seen.append(next(model.parameters()).dtype), real(model, *rest))[1])
    args = ["generate", str(run), "--prompt", "def ", "--max-tokens", "6", "--temperature", "0"]
    res = CliRunner().invoke(app, args + (["--dtype", precision] if precision else []))
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("def ")
    # Without --dtype: the run's serve.dtype, as `cs3 serve` would use.
    assert seen == [PRECISIONS[precision or "bf16"]]


@pytest.mark.parametrize("precision", [*PRECISIONS, None])
def test_export_casts_to_the_asked_precision(run, precision, tmp_path):
    out = tmp_path / "model.safetensors"
    args = ["ckpt", "export", str(run), "--out", str(out), "--json"]
    res = CliRunner().invoke(app, args + (["--dtype", precision] if precision else []))
    assert res.exit_code == 0, res.output
    want = PRECISIONS[precision or "fp32"]  # as stored: the fp32 master weights, whatever trained them
    assert json.loads(res.stdout.strip().splitlines()[-1])["dtype"] == str(want).removeprefix("torch.")
    tensors = load_file(str(out))
    torch.manual_seed(0)  # make_checkpoint's weights
    ref = Transformer(load_config(ROOT / "configs" / "tiny.yaml").model.args()).state_dict()
    assert set(tensors) == set(ref)
    for name, t in tensors.items():
        assert t.dtype == want, name
        assert torch.equal(t, ref[name].to(want)), name


@pytest.mark.parametrize("command", [["generate", "{run}"], ["ckpt", "export", "{run}"], ["bench", "serve", "--quick"]])
def test_an_unknown_dtype_is_one_sentence_and_exit_2(run, command):
    res = CliRunner().invoke(app, [c.format(run=run) for c in command] + ["--dtype", "fp8"])
    assert res.exit_code == 2, res.output
    assert "fp8" in res.output and "fp16" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_generate_runs_where_device_says_and_refuses_a_missing_gpu(run, precision, monkeypatch):
    seen = []
    real = generate_cmd.generate_text
    monkeypatch.setattr(generate_cmd, "generate_text",
                        lambda model, *rest: (seen.append(next(model.parameters()).device.type), real(model, *rest))[1])
    args = ["generate", str(run), "--prompt", "def ", "--max-tokens", "4", "--temperature", "0", "--dtype", precision]
    for device in ("cpu", "auto"):
        res = CliRunner().invoke(app, args + ["--device", device])
        assert res.exit_code == 0, res.output
    assert seen == ["cpu", "cuda" if torch.cuda.is_available() else "cpu"]
    for device, message in (("tpu", "unknown --device 'tpu'"), *((("cuda", "no CUDA device"),)
                                                                  if not torch.cuda.is_available() else ())):
        res = CliRunner().invoke(app, args + ["--device", device])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_generate_on_cuda_in_each_precision(run, precision, monkeypatch):
    seen = []
    real = generate_cmd.generate_text
    monkeypatch.setattr(generate_cmd, "generate_text",
                        lambda model, *rest: (seen.append(next(model.parameters()).device.type), real(model, *rest))[1])
    args = ["generate", str(run), "--prompt", "def ", "--max-tokens", "6", "--temperature", "0", "--dtype", precision]
    on_gpu = CliRunner().invoke(app, args + ["--device", "cuda"])
    assert on_gpu.exit_code == 0, on_gpu.output
    assert seen == ["cuda"] and on_gpu.stdout.startswith("def ")
