"""`cs3` as a user runs it on a checkpoint from an untrusted source: a crafted pickle is one line, exit 2;
model.target is imported with --trust-code; a stored name that is a path (a checkpoint or shard manifest, an
item of `.metadata`, a Hugging Face index) is one line naming the file, exit 2, and nothing outside is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cs3ray.ckpt.chunks import METADATA

from conftest import run_cs3
from helpers.serve_checkpoints import make_checkpoint
from helpers.shard_sets import make_shard_set
from helpers.untrusted import (
    HF_CONFIG,
    Outside,
    Touch,
    crafted_metadata,
    list_in_manifest,
    plant,
    rewrite_metadata,
    write_target_module,
)


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


def _checkpoint_manifest(tmp_path: Path, outside: Outside) -> tuple[list[str], str]:
    folder = Path(make_checkpoint(tmp_path / "run"))
    list_in_manifest(folder, outside.names(folder)["climbing"], outside.size, outside.sha256)
    return ["ckpt", "verify", str(tmp_path / "run")], f"{folder}/manifest.json"


def _metadata_item(tmp_path: Path, outside: Outside) -> tuple[list[str], str]:
    folder = Path(make_checkpoint(tmp_path / "run"))
    climb = outside.names(tmp_path / "run" / "chunks" / "xx")["climbing"]
    rewrite_metadata(folder, lambda md: next(iter(md.storage_data.values())).update(chunk=climb))
    return ["generate", str(folder), "--prompt", "a", "--max-tokens", "1", "--dtype", "fp32"], f"{folder}/{METADATA}"


def _hf_index(tmp_path: Path, outside: Outside) -> tuple[list[str], str]:
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(HF_CONFIG))
    index = {"weight_map": {"model.norm.weight": outside.names(src)["climbing"]}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return ["ckpt", "import-hf", str(src), "--name", str(tmp_path / "imported"), "--tokenizer", "byte"], f"{src}/model.safetensors.index.json"


def _shard_manifest(tmp_path: Path, outside: Outside) -> tuple[list[str], str]:
    dest = tmp_path / "set"
    make_shard_set(dest, n_shards=2, samples_per_shard=16, seq_len=8)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["splits"]["train"][0].update(file=str(outside.secret), bytes=outside.size, sha256=outside.sha256)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return ["cache", "warm", str(dest), f"cache.disk_dir={tmp_path / 'l2'}"], f"{dest}/manifest.json"


@pytest.mark.parametrize("forge", [_checkpoint_manifest, _metadata_item, _hf_index, _shard_manifest],
                         ids=["ckpt-verify", "generate", "import-hf", "cache-warm"])
def test_cli_refuses_a_stored_name_that_is_a_path_in_one_line(tmp_path, forge):
    outside = Outside(tmp_path)
    args, manifest = forge(tmp_path, outside)
    proc = run_cs3(args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"'{manifest}' names the" in proc.stderr and "refusing to read it" in proc.stderr, proc.stderr
    outside.untouched()
    assert not (tmp_path / "imported").exists()
