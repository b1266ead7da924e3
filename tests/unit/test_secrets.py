"""Credentials in storage options are redacted wherever a config is written or shown, and commands that
read a run take storage options at run time (`storage.options.KEY=VALUE`, `--storage-options JSON`)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import (
    ConfigError,
    build_config,
    config_hash,
    load_config,
    redact_options,
    runtime_storage_options,
    to_yaml,
)
from cs3ray_cli.main import app

SECRET = "cs3-unit-secret-7f3a9c"
ROOT = Path(__file__).resolve().parents[2]

# What s3fs, botocore, gcsfs, adlfs and the password-based backends call a credential, spelt as users do.
CREDENTIALS = ["key", "secret", "token", "session_token", "password", "aws_access_key_id", "AWS_SECRET_ACCESS_KEY",
               "aws_session_token", "account_key", "sas_token", "client_secret", "connection_string", "credentials",
               "credential", "SSECustomerKey", "Secret"]
NOT_CREDENTIALS = {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1", "anon": False,
                   "profile": "dev", "account_name": "acct", "client_id": "app", "use_ssl": True}


@pytest.mark.parametrize("name", CREDENTIALS)
def test_every_backends_credential_is_redacted_at_any_depth(name):
    options = {name: SECRET, "client_kwargs": {name: SECRET, **NOT_CREDENTIALS},
               "s3_additional_kwargs": [{name: SECRET}], f"client_kwargs.{name}": SECRET, **NOT_CREDENTIALS}
    before = json.dumps(options)
    out = redact_options(options)
    assert SECRET not in json.dumps(out)
    assert out[name] == out["client_kwargs"][name] == out[f"client_kwargs.{name}"] == "***"
    assert {k: out[k] for k in NOT_CREDENTIALS} == NOT_CREDENTIALS == \
        {k: out["client_kwargs"][k] for k in NOT_CREDENTIALS}
    assert json.dumps(options) == before  # the live options are left as they are


def _cfg(secret: str = SECRET):
    return load_config(None, [f"storage.options.key=AKID{secret}", f"storage.options.secret={secret}",
                              f"storage.options.client_kwargs.aws_session_token={secret}",
                              "storage.options.client_kwargs.endpoint_url=http://127.0.0.1:9000"])


def test_written_config_and_its_hash_hold_no_credentials_and_the_live_config_keeps_them():
    cfg = _cfg()
    text = to_yaml(cfg)
    assert SECRET not in text and text.count("'***'") == 3 and "endpoint_url: http://127.0.0.1:9000" in text
    assert cfg.storage.options["secret"] == SECRET  # workers still get the real options
    assert config_hash(cfg) == config_hash(_cfg("another-secret"))
    # A written config loads back without the masks: credentials then come from overrides or the environment.
    back = build_config(yaml.safe_load(text))
    assert back.storage.options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}


def test_config_show_prints_credentials_as_stars(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"storage": {"options": {"client_kwargs": {"aws_secret_access_key": SECRET}}}}))
    shown = CliRunner().invoke(app, ["config", "show", str(path), f"storage.options.password={SECRET}"])
    assert shown.exit_code == 0, shown.output
    assert SECRET not in shown.output
    options = yaml.safe_load(shown.stdout)["storage"]["options"]
    assert options == {"client_kwargs": {"aws_secret_access_key": "***"}, "password": "***"}
    bad = CliRunner().invoke(app, ["config", "show", str(path), f"storage.options={SECRET}"])
    assert bad.exit_code == 2 and SECRET not in bad.output and "storage.options is invalid" in bad.output


def test_a_checkpoint_never_holds_the_credentials_of_the_config_it_is_given(tmp_path):
    raw = yaml.safe_dump(_cfg().model_dump(mode="json"), sort_keys=False)  # as a careless caller might pass it
    assert SECRET in raw
    mgr = CheckpointManager(str(tmp_path / "run"), keep=1, replicas=[str(tmp_path / "replica")])
    mgr.save(1, {"w": torch.ones(4)}, {"step": 1}, {}, {"config.yaml": raw})
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 8 and not [p for p in files if SECRET.encode() in p.read_bytes()]
    stored = (tmp_path / "run" / "step-00000001" / "config.yaml").read_text()
    assert stored == to_yaml(_cfg())
    manifest = json.loads((tmp_path / "run" / "step-00000001" / "manifest.json").read_text())
    assert manifest["config_hash"] == hashlib.sha256(stored.encode()).hexdigest()


def test_storage_options_at_run_time_parse_as_train_overrides_do():
    given = runtime_storage_options(["storage.options.client_kwargs.endpoint_url=http://e:9000",
                                     "storage.options.anon=false"], '{"key": "k", "client_kwargs": {"region_name": "r"}}')
    assert given == {"key": "k", "anon": False, "client_kwargs": {"region_name": "r", "endpoint_url": "http://e:9000"}}
    assert runtime_storage_options(["storage.options={secret: s}"]) == {"secret": "s"}
    assert runtime_storage_options() == {}  # nothing given: the backend's own credential chain
    for args, json_text, needle in ((["train.lr=3e-4"], None, "argument 'train.lr' is not a storage option"),
                                    (["storage.options=3"], None, "storage.options must be a mapping"),
                                    ([], "[1]", "--storage-options must be a JSON object"),
                                    (["storage.options.key"], None, "must look like section.field=value"),
                                    ([f"storage.options..secret={SECRET}"], None, "has an empty field name"),
                                    (["storage.options.key=k", f"storage.options.key.id={SECRET}"], None,
                                     "'key' is a value, not a section")):
        with pytest.raises(ConfigError) as info:
            runtime_storage_options(args, json_text)
        assert needle in str(info.value) and "\n" not in str(info.value) and SECRET not in str(info.value)


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["ckpt", "ls"], ["ckpt", "verify"], ["ckpt", "export"]])
def test_commands_that_read_a_run_take_only_storage_options_after_it(command, tmp_path):
    res = CliRunner().invoke(app, [*command, str(tmp_path / "run"), "storage.options.anon=true",
                                   f"storage.option.secret={SECRET}"])
    assert res.exit_code == 2, res.output
    assert "argument 'storage.option.secret' is not a storage option" in res.output
    assert SECRET not in res.output and "Traceback" not in res.output


def test_serve_job_takes_storage_options_as_cs3_serve_does(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("serve_job", ROOT / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main([str(tmp_path / "run"), "--host", "127.0.0.1", "train.lr=1"]) == 2
    assert "argument 'train.lr' is not a storage option" in capsys.readouterr().err
    # Accepted options reach the run lookup (which then finds no run here).
    assert job.main([str(tmp_path / "run"), "--host", "127.0.0.1", "storage.options.anon=true",
                     "--storage-options", '{"key": "k"}']) == 2
    assert "does not exist" in capsys.readouterr().err
