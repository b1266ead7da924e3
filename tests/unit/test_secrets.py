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


# -- any nesting of options, any place a credential hides (property tests) ------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cs3ray.config.redact import MASK, redact_config, redact_value, secret_fields  # noqa: E402

# What the HTTP, ssh and OAuth options of the fsspec backends call a credential, besides CREDENTIALS above.
MORE_CREDENTIALS = ["Authorization", "Proxy-Authorization", "Cookie", "Set-Cookie", "X-Api-Key", "access_token",
                    "refresh_token", "id_token", "pkey", "private_key", "passphrase", "X-Amz-Security-Token"]
SAFE_KEYS = ["endpoint_url", "region_name", "anon", "use_ssl", "key_filename", "client_kwargs", "config_kwargs",
             "headers", "s3_additional_kwargs", "profile", "account_name", "client_id", "timeout", "Accept", "host"]
# No space, ':' or '@': a safe leaf can never look like a URL's password, a private key or an HTTP credential.
SAFE_TEXT = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./", max_size=12)
SAFE_TREES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), SAFE_TEXT),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(SAFE_KEYS), kids, max_size=3)),
    max_leaves=12)
PEM = "-----BEGIN {kind}PRIVATE KEY-----\nMIIE{secret}\n-----END {kind}PRIVATE KEY-----\n"


def _containers(node, out):
    if isinstance(node, (dict, list)):
        out.append(node)
        for child in (node.values() if isinstance(node, dict) else node):
            _containers(child, out)
    return out


@settings(max_examples=300, deadline=None)
@given(tree=st.dictionaries(st.sampled_from(SAFE_KEYS), SAFE_TREES, max_size=4), data=st.data(),
       secret=st.text("abcdef0123456789", min_size=8, max_size=16).map(lambda s: f"S3CRET{s}"))
def test_a_credential_planted_anywhere_in_nested_options_is_hidden_and_nothing_else_is(tree, data, secret):
    name = data.draw(st.sampled_from(CREDENTIALS + MORE_CREDENTIALS))
    kind = data.draw(st.sampled_from(["named", "named-dict", "url", "pem", "bearer", "header-pair"]))
    value, shown = {
        "named": (secret, MASK),  # gcsfs's token, adlfs's sas_token, an Authorization header...
        "named-dict": ({"type": "service_account", "private_key_id": secret}, MASK),  # gcsfs's credentials dict
        "url": (f"sftp://me:{secret}@host:22/data", "sftp://me:***@host:22/data"),
        "pem": (PEM.format(kind=data.draw(st.sampled_from(["", "RSA ", "OPENSSH ", "EC "])), secret=secret), MASK),
        "bearer": (f"{data.draw(st.sampled_from(['Bearer', 'Basic', 'token']))} {secret}", MASK),
        "header-pair": ([name, secret], [name, MASK]),
    }[kind]
    expected = json.loads(json.dumps(tree))
    at = data.draw(st.integers(0, len(_containers(tree, [])) - 1))  # the same walk finds the same place in both
    target, where = _containers(tree, [])[at], _containers(expected, [])[at]
    if isinstance(target, dict):
        key = name if kind.startswith("named") else data.draw(st.sampled_from(SAFE_KEYS))
        target[key], where[key] = value, shown
    elif kind.startswith("named"):  # a list of option dicts (s3_additional_kwargs: [{...}])
        target.append({name: value})
        where.append({name: shown})
    else:
        target.append(value)
        where.append(shown)
    before = json.dumps(tree)
    out = redact_options(tree)
    assert secret not in json.dumps(out)
    assert out == expected  # every other value as it was
    assert json.dumps(tree) == before
    assert secret_fields({"storage": {"options": tree}})  # what `cs3 submit` refuses


URL_FIELDS = ["run.dir", "train.init_from", "data.source", "data.cache_dir", "checkpoint.replicas"]


@settings(max_examples=100, deadline=None)
@given(field=st.sampled_from(URL_FIELDS), scheme=st.sampled_from(["s3", "https", "sftp", "ftp", "gs", "abfs"]),
       secret=st.text("abcdef0123456789%~!$&'()*+,;=", min_size=6, max_size=16).map(lambda s: f"S3CRET{s}"))
def test_a_urls_password_is_hidden_in_every_field_of_a_config(field, scheme, secret):
    section, key = field.split(".")
    url = f"{scheme}://user:{secret}@host:9000/bucket/runs"
    data = {"run": {"name": "tiny", "dir": "runs/tiny"}, "data": {"tokenizer": "byte"},
            "storage": {"options": {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}}}
    data.setdefault(section, {})[key] = [url, "s3://b/model@v2"] if key == "replicas" else url
    out = redact_config(data)
    assert secret not in json.dumps(out)
    assert f"{scheme}://user:***@host:9000/bucket/runs" in json.dumps(out)
    assert out["storage"] == data["storage"] and out["data"]["tokenizer"] == "byte"
    assert secret_fields(data) == [f"{field}[0]" if key == "replicas" else field]
    assert redact_config(out) == out  # masking twice changes nothing


def test_values_that_only_resemble_credentials_are_kept():
    kept = ["http://127.0.0.1:9000", "s3://bucket/model@v2", "http://host:8080/a@b", "/home/me/.ssh/id_ed25519",
            "sftp://me@host/data", "-----BEGIN CERTIFICATE-----"]
    assert [redact_value(v) for v in kept] == kept
    assert redact_options({"key_filename": "/k", "client_cert": "/c.pem", "tokenizer_url": None}) == \
        {"key_filename": "/k", "client_cert": "/c.pem", "tokenizer_url": None}


def test_a_checkpoint_and_the_event_log_hide_a_urls_password(tmp_path):
    from cs3ray.ops.events import EventLog
    from cs3ray.storage import open_url

    mgr = CheckpointManager(str(tmp_path / "run"), keep=1)
    mgr.save(1, {"w": torch.ones(4)}, {"step": 1, "imported_from": f"https://me:{SECRET}@hub.example/model"}, {},
             {"config.yaml": to_yaml(load_config(None, [f"train.init_from=sftp://me:{SECRET}@host/run"]))})
    log = EventLog(open_url(str(tmp_path / "run")))
    log.add({"event": "checkpoint", "url": f"s3://k:{SECRET}@bucket/run/step-1"})
    log.flush()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5 and not [p for p in files if SECRET.encode() in p.read_bytes()]
    assert "https://me:***@hub.example/model" in (tmp_path / "run" / "step-00000001" / "state.json").read_text()


def test_an_unreachable_storage_url_is_named_without_its_password():
    # A storage error names its URL; the user:password in it stays hidden (nothing listens on port 1).
    result = CliRunner().invoke(app, ["ckpt", "ls", f"http://me:{SECRET}@127.0.0.1:1/run"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert SECRET not in result.output and "http://me:***@127.0.0.1:1/run" in result.output.replace("\n", "")


# -- `cs3 submit` and jobs/train.py refuse credentials bound for a job's metadata ---------------------------------


@pytest.mark.parametrize("args", [
    [f"storage.options.secret={SECRET}"],
    [f"storage.options.client_kwargs.headers.Authorization=Bearer {SECRET}"],
    ["storage.options={token: " + SECRET + "}"],
    [f"checkpoint.replicas=[s3://b/r, 'sftp://me:{SECRET}@host/r']"],
    [f"run.dir=https://me:{SECRET}@host/runs"],
    ["--env", f"AWS_SECRET_ACCESS_KEY={SECRET}"],
    ["--env", "HF_TOKEN"],
    ["--env", f"DB=postgres://me:{SECRET}@db/x"],
])
def test_submit_refuses_a_credential_before_it_reaches_the_cluster(args, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    # An address nothing listens on: the refusal comes first, nothing is contacted or uploaded.
    res = CliRunner().invoke(app, ["submit", "configs/tiny.yaml", *args, "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert SECRET not in res.output and "refusing" in res.output and "Traceback" not in res.output
    assert "`ray job list` shows" in res.output and "environment variables of `ray start`" in res.output, lines


def test_submit_refuses_a_config_file_holding_a_credential_and_takes_the_harmless(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("job.yaml").write_text(yaml.safe_dump({"storage": {"options": {"client_kwargs": {"aws_secret_access_key":
                                                                                           SECRET}}}}))
    res = CliRunner().invoke(app, ["submit", "job.yaml", "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and SECRET not in res.output
    assert "'storage.options.client_kwargs.aws_secret_access_key' holds a credential" in res.output
    # Not credentials: the refusal is for what it names, not for words that contain 'token' or 'key'.
    Path("job.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "byte"}, "storage": {"options": {
        "key_filename": "/k", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}}}))
    res = CliRunner().invoke(app, ["submit", "job.yaml", "serve.max_prefill_tokens=64", "--env",
                                   "TOKENIZERS_PARALLELISM=false", "--env", "AWS_PROFILE=dev",
                                   "--address", "http://127.0.0.1:1"])
    assert res.exit_code == 2 and "cannot reach the Ray cluster" in res.output and "refusing" not in res.output


def test_the_training_job_refuses_a_credential_in_its_entrypoint(capsys):
    spec = importlib.util.spec_from_file_location("train_job", ROOT / "jobs" / "train.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main([str(ROOT / "configs/tiny.yaml"), f"storage.options.key={SECRET}"]) == 2
    err = capsys.readouterr().err
    assert "refusing the credential in 'storage.options.key' in the job's entrypoint" in err and SECRET not in err


def test_cs3_jobs_shows_others_entrypoints_without_their_credentials():
    from cs3ray.ops.job_credentials import redact_entrypoint

    given = (f"python jobs/train.py configs/tiny.yaml storage.options.secret={SECRET} "
             f"'run.dir=s3://me:{SECRET}@bucket/runs' train.steps=3 --token-file /etc/cs3/token")
    shown = redact_entrypoint(given)
    assert SECRET not in shown and "train.steps=3" in shown and "--token-file /etc/cs3/token" in shown
    assert "'storage.options.secret=***'" in shown and "run.dir=s3://me:***@bucket/runs" in shown
    harmless = "python jobs/train.py configs/tiny.yaml data.tokenizer=byte 'run.name=a b'"
    assert redact_entrypoint(harmless) == harmless  # as Ray stored it, quoting and all
    assert SECRET not in redact_entrypoint(f"python x.py \"unbalanced https://me:{SECRET}@host")
