"""`cs3 ckpt ls|verify|export` in process (typer's runner): listing, checksum sweep, consolidated export."""

import json

import torch
from typer.testing import CliRunner

from cs3ray.ckpt import CheckpointManager

from helpers.ckpt_runs import save, small_model


def test_export_and_cli(tmp_path):
    from safetensors.torch import load_file

    from cs3ray_cli.main import app

    mgr = CheckpointManager(str(tmp_path / "run"), keep=3)
    model = small_model()
    save(mgr, model, 3)
    save(mgr, model, 4)
    runner = CliRunner()
    res = runner.invoke(app, ["ckpt", "ls", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    assert [c["step"] for c in json.loads(res.stdout.strip().splitlines()[-1])["checkpoints"]] == [3, 4]
    res = runner.invoke(app, ["ckpt", "verify", f"{tmp_path / 'run'}/4"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "m.safetensors"
    res = runner.invoke(app, ["ckpt", "export", str(tmp_path / "run"), "--format", "safetensors", "--out", str(out)])
    assert res.exit_code == 0, res.output
    tensors = load_file(str(out))
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())
    res = runner.invoke(app, ["ckpt", "export", f"{tmp_path / 'run'}/3", "--format", "torch", "--out",
                              str(tmp_path / "m.pt")])
    assert res.exit_code == 0, res.output
    plain = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(plain) == set(model.state_dict())
    meta = tmp_path / "run" / "step-00000004" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-5])
    res = runner.invoke(app, ["ckpt", "verify", str(tmp_path / "run")])
    assert res.exit_code == 2 and "checksum" in res.output
    res = runner.invoke(app, ["ckpt", "export", str(tmp_path / "run"), "--format", "onnx"])
    assert res.exit_code == 2
