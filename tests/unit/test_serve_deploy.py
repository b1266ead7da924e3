"""From a checkpoint to a Serve application: the serve config section, overrides, resources, autoscaling."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from cs3ray.config.schema import ServeConfig
from cs3ray.errors import UserError
from cs3ray.ops.cluster_env import (
    HAPROXY_ENV,
    HAPROXY_FILES,
    HAPROXY_SIDE_PORTS,
    HAPROXY_SWITCH,
    export_cluster_env,
)
from cs3ray.serve.deploy import build_app, check_bound, check_exposure, make_spec, pick_token
from cs3ray.serve.launch import cluster_cpus, run_app
from cs3ray.serve.spec import ServeSpec
from cs3ray.serve.tuning import replica_actor_options

from conftest import ROOT
from helpers.serve_checkpoints import make_checkpoint
from helpers.tls import make_tls


def deployment_config(app):
    dep = app._bound_deployment
    return dep._deployment_config, dep.ray_actor_options


def test_spec_reads_the_checkpoints_serve_section_with_cli_overrides(tmp_path):
    make_checkpoint(tmp_path / "run", overrides=["serve.max_batch=7", "serve.num_cpus=0.5", "run.name=mine"])
    spec = make_spec(str(tmp_path / "run"), overrides={"replicas": 3, "dtype": None})
    assert spec.name == "mine" and spec.run == str(tmp_path / "run")
    assert spec.serve.max_batch == 7 and spec.serve.replicas == 3 and spec.serve.dtype == "auto"
    assert spec.engine_options().max_batch == 7 and spec.engine_options().threads == 1
    config, actor = deployment_config(build_app(spec))
    assert config.num_replicas == 3 and actor["num_cpus"] == 0.5
    # Serve runs the replica's routes on its main event loop (see serve.tuning).
    assert actor["runtime_env"]["env_vars"] == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert config.autoscaling_config is None


def test_serve_threads_sets_torch_threads_apart_from_the_cpus_reserved(tmp_path):
    make_checkpoint(tmp_path / "run", overrides=["serve.num_cpus=2"])
    spec = make_spec(str(tmp_path / "run"))
    assert spec.engine_options().threads == 2  # unset: the replica's CPU share
    assert spec.serve.max_batch is None and spec.engine_options().max_batch == 16  # the built-in engine's default
    spec = make_spec(str(tmp_path / "run"), overrides={"threads": 1})
    _, actor = deployment_config(build_app(spec))
    assert spec.engine_options().threads == 1 and actor["num_cpus"] == 2.0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_named_precision_is_served_as_asked_on_cpu(tmp_path, precision):
    import torch

    make_checkpoint(tmp_path / "run")
    spec = make_spec(str(tmp_path / "run"), overrides={"dtype": precision})
    # fp16 too: slow on a CPU without fp16 matmuls, but not silently served in another precision.
    assert spec.dtype("cpu") == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def test_autoscaling_from_config(tmp_path):
    make_checkpoint(tmp_path / "run", overrides=["serve.min_replicas=1", "serve.max_replicas=4",
                                                 "serve.target_ongoing_requests=24", "serve.num_gpus=0.25"])
    spec = make_spec(str(tmp_path / "run"))
    spec.autoscaling_options = {"upscale_delay_s": 2.0, "downscale_delay_s": 5.0}
    config, actor = deployment_config(build_app(spec))
    auto = config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 24)
    assert (auto.upscale_delay_s, auto.downscale_delay_s) == (2.0, 5.0)
    assert actor["num_gpus"] == 0.25


def test_an_embedded_serving_cluster_declares_cpus_for_every_replica():
    assert cluster_cpus(ServeConfig()) == 2
    assert cluster_cpus(ServeConfig(replicas=3, num_cpus=1.5)) == 6
    assert cluster_cpus(ServeConfig(replicas=1, min_replicas=0, max_replicas=4, num_cpus=0.5)) == 3  # the maximum
    assert cluster_cpus(ServeConfig(replicas=5, max_replicas=2)) == 6  # no min_replicas: not autoscaling


def test_detach_needs_an_address_before_any_ray(tmp_path):
    with pytest.raises(UserError, match="--detach needs --address"):
        run_app(ServeSpec(run=str(tmp_path), name="app"), detach=True)


def test_replica_env_keeps_the_users_runtime_env():
    options = replica_actor_options({"num_cpus": 1, "runtime_env": {
        "pip": ["x"], "env_vars": {"A": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}}})
    assert options["num_cpus"] == 1 and options["runtime_env"]["pip"] == ["x"]
    assert options["runtime_env"]["env_vars"] == {"A": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}


def test_cluster_env_keeps_what_the_user_set(monkeypatch):
    for key in ("RAY_worker_niceness", *HAPROXY_ENV, *HAPROXY_SIDE_PORTS, *HAPROXY_FILES):
        monkeypatch.setenv(key, "15")  # so that the test's own export is undone after it
        monkeypatch.delenv(key)
    monkeypatch.setenv("RAY_SERVE_PROXY_USE_GRPC", "0")
    export_cluster_env()
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "0"
    monkeypatch.delenv("RAY_SERVE_PROXY_USE_GRPC")
    export_cluster_env()
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    assert os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"  # the proxy routes on its own loop
    assert "RAY_worker_niceness" not in os.environ  # a training cluster keeps Ray's nice 15 workers
    export_cluster_env(serving=True)
    assert os.environ["RAY_worker_niceness"] == "0"  # a serving one runs them at nice 0
    # Serve's HAProxy ingress only where asked: its stats and metrics listen on every interface.
    assert HAPROXY_SWITCH not in os.environ and not {*HAPROXY_SIDE_PORTS, *HAPROXY_FILES} & set(os.environ)


def test_haproxy_where_asked_keeps_its_files_in_a_private_folder(monkeypatch):
    for key in (*HAPROXY_ENV, *HAPROXY_SIDE_PORTS, *HAPROXY_FILES):
        monkeypatch.setenv(key, "15")
        monkeypatch.delenv(key)
    monkeypatch.setenv(HAPROXY_SWITCH, "1")
    export_cluster_env(serving=True)
    assert os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "3"
    ports = {int(os.environ[key]) for key in HAPROXY_SIDE_PORTS}  # free ones, not the fixed defaults
    assert len(ports) == len(HAPROXY_SIDE_PORTS) and not ports & {8404, 9101, 8500, 9500}
    folder = Path(os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    try:
        # Not Serve's shared /tmp/haproxy-serve, where its admin socket (mode 666) lets anyone reconfigure it.
        assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
        assert all(Path(os.environ[key]).parent == folder for key in HAPROXY_FILES if key != "RAY_SERVE_HAPROXY_SERVER_STATE_BASE")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_token_file_and_its_refusals(tmp_path):
    (tmp_path / "token").write_text("  s3cret\n")
    assert pick_token(None, str(tmp_path / "token")) == "s3cret"
    assert pick_token("given", None) == "given" and pick_token(None, None) is None
    with pytest.raises(UserError, match="both give a token"):
        pick_token("given", str(tmp_path / "token"))
    with pytest.raises(UserError, match="cannot read the token file"):
        pick_token(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        pick_token(None, str(tmp_path / "empty"))


def test_tls_files_checked_before_any_ray(tmp_path, monkeypatch):
    tls = make_tls(tmp_path)
    run = tmp_path / "run"
    make_checkpoint(run)
    monkeypatch.chdir(tmp_path)  # relative paths become absolute: Serve's proxy runs in another directory
    spec = make_spec(str(run), overrides={"tls_cert": "server.pem", "tls_key": "server.key"})
    assert (spec.serve.tls_cert, spec.serve.tls_key) == (str(tls.cert), str(tls.key))
    with pytest.raises(UserError, match="needs both --tls-cert and --tls-key"):
        make_spec(str(run), overrides={"tls_cert": str(tls.cert)})
    with pytest.raises(UserError, match="does not exist"):
        make_spec(str(run), overrides={"tls_cert": str(tls.cert), "tls_key": str(tmp_path / "nope")})
    (tmp_path / "other").mkdir()
    other = make_tls(tmp_path / "other")
    with pytest.raises(UserError, match="cannot use TLS certificate"):  # a key of another certificate
        make_spec(str(run), overrides={"tls_cert": str(tls.cert), "tls_key": str(other.key)})


def test_exposure_is_checked_on_the_options_serve_runs_with():
    """A running Serve keeps its HTTP options: what it listens on decides, not what was asked."""
    from ray.serve.config import HTTPOptions

    open_spec = ServeSpec(run="r", name="m")
    with pytest.raises(UserError, match=r"listens on 0\.0\.0\.0:8123, not a loopback"):
        check_bound(open_spec, HTTPOptions(host="0.0.0.0", port=8123), 8000)
    assert check_bound(open_spec, HTTPOptions(host="127.0.0.1", port=8123), 8000) == "http://127.0.0.1:8123"
    token_spec = ServeSpec(run="r", name="m", token="t", route_prefix="/api")
    assert check_bound(token_spec, HTTPOptions(host="0.0.0.0", port=8123), 8000) == "http://127.0.0.1:8123/api"
    assert check_bound(ServeSpec(run="r", name="m", insecure=True), HTTPOptions(host="::", port=1), 1)
    tls_spec = ServeSpec(run="r", name="m", serve=ServeConfig(tls_cert="/c", tls_key="/k"))
    with pytest.raises(UserError, match="without TLS"):
        check_bound(tls_spec, HTTPOptions(host="127.0.0.1", port=8123), 8000)
    assert check_bound(tls_spec, HTTPOptions(host="127.0.0.1", port=9, ssl_certfile="/c", ssl_keyfile="/k"), 9) \
        == "https://127.0.0.1:9"


def test_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        make_spec(str(tmp_path / "missing"))
    ckpt = make_checkpoint(tmp_path / "run")
    with pytest.raises(UserError, match="--follow needs a run directory"):
        make_spec(ckpt, follow=True)
    with pytest.raises(UserError, match="serve.dtype"):
        make_spec(str(tmp_path / "run"), overrides={"dtype": "fp8"})
    with pytest.raises(UserError, match="--token is empty"):
        make_spec(str(tmp_path / "run"), token=" ")


@pytest.mark.parametrize("host,token,insecure,allowed", [
    ("127.0.0.1", None, False, True), ("127.8.9.10", None, False, True), ("::1", None, False, True),
    ("[::1]", None, False, True), ("localhost", None, False, True),
    ("0.0.0.0", None, False, False), ("::", None, False, False), ("10.1.2.3", None, False, False),
    ("node-7.cluster", None, False, False),
    ("0.0.0.0", "tok", False, True), ("0.0.0.0", None, True, True), ("10.1.2.3", None, True, True),
])
def test_an_open_api_beyond_loopback_needs_a_token_or_insecure(host, token, insecure, allowed):
    if allowed:
        check_exposure(host, token, insecure)
        return
    with pytest.raises(UserError, match=r"--token-file or CS3_SERVE_TOKEN, or pass --insecure") as info:
        check_exposure(host, token, insecure)
    assert "\n" not in str(info.value)


def test_make_spec_checks_exposure_first_and_keeps_the_users_word(tmp_path):
    with pytest.raises(UserError, match="--insecure"):
        make_spec(str(tmp_path / "missing"), host="0.0.0.0")  # before even looking for the run
    make_checkpoint(tmp_path / "run")
    spec = make_spec(str(tmp_path / "run"), host="0.0.0.0", insecure=True)
    assert spec.insecure and spec.token is None and not spec.trust_code
    assert make_spec(str(tmp_path / "run"), host="0.0.0.0", token="t").token == "t"
    assert "s3cret" not in repr(make_spec(str(tmp_path / "run"), token="s3cret"))  # the token stays out of logs


def jobs_serve():
    """jobs/serve.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("jobs_serve", ROOT / "jobs" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_jobs_serve_on_its_default_host_needs_a_token_before_connecting(tmp_path, monkeypatch, capsys):
    make_checkpoint(tmp_path / "run")
    monkeypatch.delenv("CS3_SERVE_TOKEN", raising=False)
    # Nothing listens there: a job that tried to connect first would fail with another message.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert jobs_serve().main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--token-file or CS3_SERVE_TOKEN, or pass --insecure" in err and "0.0.0.0" in err
    assert len(err.strip().splitlines()) == 1


def test_jobs_serve_takes_every_option_of_cs3_serve(capsys):
    import typer.main

    from cs3ray_cli.main import app

    command = typer.main.get_command(app).commands["serve"]
    cli = {opt for p in command.params for opt in p.opts if opt.startswith("--")}
    with pytest.raises(SystemExit):
        jobs_serve().main(["--help"])
    job = set(re.findall(r"(--[a-z][a-z-]*)", capsys.readouterr().out))
    # A job runs on the cluster it was submitted to until `ray job stop`: no --address, no --detach, and
    # that cluster's ingress was chosen when it started (no --haproxy).
    assert cli - {"--address", "--detach", "--haproxy", "--help"} <= job, cli - job
