"""`cs3` as a user runs it on a checkpoint from an untrusted source: a crafted pickle is one line, exit 2;
model.target is imported with --trust-code."""

from __future__ import annotations

import os
from pathlib import Path

from cs3ray.ckpt.chunks import METADATA

from conftest import run_cs3
from helpers.serve_checkpoints import make_checkpoint
from helpers.untrusted import Touch, crafted_metadata, plant, write_target_module


def test_cli_export_of_a_crafted_checkpoint_is_one_line(tmp_path):
    marker = tmp_path / "payload-ran"
    folder = Path(make_checkpoint(tmp_path / "run"))
    plant(folder, METADATA, crafted_metadata(folder, Touch(marker)))
    proc = run_cs3(["ckpt", "export", str(folder), "--out", str(tmp_path / "m.safetensors")], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to load it" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "m.safetensors").exists()


def test_cli_generate_with_trust_code_imports_the_target(tmp_path):
    target, marker = write_target_module(tmp_path)
    folder = make_checkpoint(tmp_path / "run", overrides=[f"model.target={target}"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run_cs3(["generate", folder, "--prompt", "a", "--max-tokens", "1", "--dtype", "fp32", "--trust-code"], env=env,
            timeout=120, check=True)
    assert marker.exists()
