"""No credential is ever stored: a real run on S3 (moto) with key/secret in its config, then read back.

The run trains on the session's Ray head with `run.dir` and a replica on the bucket; `cs3 ckpt ls`,
`cs3 ckpt export`, `cs3 generate`, a resume check and a serve spec read it with the credentials
given as trailing `storage.options.*` arguments, and `cs3 generate` once more with environment
variables only.
Afterwards no object in the bucket and no file the run or the commands wrote holds the key or secret, and the
shards and the shard cache written locally are readable by their owner only.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import run_cs3
from helpers.modes import not_private

SECRET = f"cs3-secret-{uuid.uuid4().hex}"
KEY = f"AKIDCS3{uuid.uuid4().hex[:12].upper()}"


def _no_credentials_env(base: dict[str, str] | None = None) -> dict[str, str]:
    # The commands must not find credentials anywhere but where each test puts them.
    return {k: v for k, v in (base or os.environ).items() if not k.startswith("AWS_")}


def _holds_secret(data: bytes) -> bool:
    return SECRET.encode() in data or KEY.encode() in data


def _files_holding_secrets(root: Path, since: float = 0.0) -> list[str]:
    found = []
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink() and p.stat().st_mtime >= since and _holds_secret(p.read_bytes()):
                found.append(str(p))
        except FileNotFoundError:  # a log file rotated away meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def s3_run(s3_server, ray_head, tmp_path_factory):
    """A 2-step run on moto with its credentials in the config; yields its URL, endpoint, folders and start time."""
    endpoint, _ = s3_server
    prefix = f"s3://cs3/secrets-{uuid.uuid4().hex[:8]}"
    user = tmp_path_factory.mktemp("user")  # the user's own config: the one place the secret may be
    work = tmp_path_factory.mktemp("work")
    name = f"secrets-{uuid.uuid4().hex[:8]}"
    config = {
        # A model of ~0.1M parameters: what is under test is where its files go, not what it learns.
        "model": {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
        "precision": "fp32",
        "data": {"max_bytes": 100_000, "samples_per_shard": 256, "cache_dir": str(work / "shards")},
        "train": {"steps": 2, "seq_len": 32, "batch_size": 4, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
                  "log_every": 1},
        # One checkpoint (each costs ~100 requests to moto), copied to a replica and the memory tier.
        "checkpoint": {"every": 2, "replicas": [f"{prefix}/replica"]},
        "cluster": {"workers": 1},
        "cache": {"disk_dir": str(work / "l2")},
        "run": {"name": name, "dir": f"{prefix}/run"},
        "storage": {"options": {"key": KEY, "secret": SECRET,
                                "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}},
    }
    path = user / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.time()
    proc = run_cs3(["train", str(path), "--address", ray_head.address, "--json"],
                   env=_no_credentials_env(ray_head.env()), check=True)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    assert SECRET not in proc.stdout + proc.stderr and KEY not in proc.stdout + proc.stderr
    yield {"url": f"{prefix}/run", "prefix": prefix, "endpoint": endpoint, "work": work, "name": name,
           "started": started, "config": path}


def _args(run: dict) -> list[str]:
    return [f"storage.options.key={KEY}", f"storage.options.secret={SECRET}",
            f"storage.options.client_kwargs.endpoint_url={run['endpoint']}",
            "storage.options.client_kwargs.region_name=us-east-1"]


def test_run_on_s3_is_read_with_credentials_given_at_run_time_or_by_the_environment(s3_run):
    from typer.testing import CliRunner

    from cs3ray_cli.main import app

    run, cli = s3_run, CliRunner()
    # In this process, parsed as `cs3` parses them.
    ls = cli.invoke(app, ["ckpt", "ls", run["url"], *_args(run), "--json"])
    assert ls.exit_code == 0, ls.output
    assert [c["step"] for c in json.loads(ls.stdout.strip().splitlines()[-1])["checkpoints"]] == [2]
    out = run["work"] / "model.safetensors"
    exported = cli.invoke(app, ["ckpt", "export", run["url"], *_args(run), "-o", str(out)])
    assert exported.exit_code == 0 and out.stat().st_size > 0, exported.output
    gen = ["generate", run["url"], "--prompt", "def ", "--max-tokens", "12", "--seed", "0", "--temperature", "0"]
    by_args = cli.invoke(app, [*gen, *_args(run)])
    assert by_args.exit_code == 0 and by_args.stdout.startswith("def "), by_args.output
    # The backend's own credential chain: no option at all, only AWS_* variables (a fresh process).
    by_env = run_cs3(gen, env=_no_credentials_env() | {
        "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL_S3": run["endpoint"],
        "AWS_DEFAULT_REGION": "us-east-1"}, check=True)
    assert by_env.stdout.startswith("def ")
    # `cs3 train --resume` finds the run with the credentials given as overrides (checked here without Ray).
    from cs3ray.config import load_config, runtime_storage_options
    from cs3ray.serve.deploy import make_spec
    from cs3ray.train.driver import prepare_run_dir

    assert prepare_run_dir(load_config(None, [f"run.dir={run['url']}", *_args(run)]), True, False).exists("config.yaml")
    # A serve spec carries the run-time options to its replicas (built here without Ray).
    spec = make_spec(run["url"], storage_options=runtime_storage_options(_args(run)))
    assert spec.storage_options["secret"] == SECRET and spec.name == run["name"]
    assert SECRET not in repr(spec)


def test_no_credential_is_stored_anywhere(s3_run, ray_client):
    import s3fs

    from cs3ray.ckpt.keeper import MemoryTier

    run = s3_run
    # Every command of the module has run by now (this test comes after them in the file).
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": run["endpoint"]},
                           skip_instance_cache=True)
    objects = fs.find(run["prefix"].removeprefix("s3://"))
    for name in ("run/config.yaml", "run/step-00000002/config.yaml", "replica/step-00000002/config.yaml",
                 "run/events/00000000.jsonl", "run/summary.json"):
        assert any(o.endswith(name) for o in objects), name
    leaked = [o for o in objects if _holds_secret(fs.cat_file(o))]
    assert not leaked, leaked
    stored = yaml.safe_load(fs.cat_file(f"{run['prefix']}/run/step-00000002/config.yaml".removeprefix("s3://")))
    assert stored["storage"]["options"]["secret"] == "***" and stored["storage"]["options"]["key"] == "***"
    assert stored["storage"]["options"]["client_kwargs"]["endpoint_url"] == run["endpoint"]
    # The memory tier: the keepers' snapshot of the last step (its small files and manifest).
    tier = MemoryTier(run["url"])
    manifest = tier.steps()[2]
    assert "config.yaml" in manifest["files"] and not _holds_secret(json.dumps(manifest).encode())
    assert not [name for name in manifest["files"] if _holds_secret(tier.file(2, name))]
    # Local files: the data and cache dirs, the export, Ray Train's run folder, the Ray logs of this test.
    assert not _files_holding_secrets(run["work"])
    # The prepared shards and the node's shard cache, written locally by the driver and the workers: the owner's alone.
    for folder in (run["work"] / "shards", run["work"] / "l2"):
        assert any(p.is_file() for p in folder.rglob("*")) and not_private(folder) == [], folder
    for folder in (Path.home() / "ray_results").glob(f"cs3-{run['name']}-*"):
        assert not _files_holding_secrets(folder)
    logs = Path(ray_client._private.worker._global_node.get_logs_dir_path())  # the head's session (no public API)
    assert any(p.stat().st_mtime >= run["started"] for p in logs.glob("worker-*"))  # the run's workers logged here
    assert not _files_holding_secrets(logs, since=run["started"])
    # The search finds the secret where it is: in the user's own config file, and only there.
    assert _files_holding_secrets(run["config"].parent) == [str(run["config"])]
