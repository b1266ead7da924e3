"""From a checkpoint to a Serve application: the serve config section, overrides, resources, autoscaling."""

from __future__ import annotations

import os

import pytest
from serve_checkpoints import make_checkpoint

from cs3ray.errors import UserError
from cs3ray.serve.deploy import build_app, make_spec
from cs3ray.serve.tuning import (HAPROXY_ENV, HAPROXY_SIDE_PORTS, export_cluster_env, haproxy_binary,
                                 replica_actor_options)


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


def test_replica_env_keeps_the_users_runtime_env():
    options = replica_actor_options({"num_cpus": 1, "runtime_env": {
        "pip": ["x"], "env_vars": {"A": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}}})
    assert options["num_cpus"] == 1 and options["runtime_env"]["pip"] == ["x"]
    assert options["runtime_env"]["env_vars"] == {"A": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}


def test_cluster_env_keeps_what_the_user_set(monkeypatch):
    for key in ("RAY_worker_niceness", *HAPROXY_ENV, *HAPROXY_SIDE_PORTS):
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
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ  # nor Serve's HAProxy ingress
    export_cluster_env(serving=True)
    assert os.environ["RAY_worker_niceness"] == "0"  # a serving one runs them at nice 0
    if haproxy_binary():  # ray[serve] bundles HAProxy on Linux
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        ports = {int(os.environ[key]) for key in HAPROXY_SIDE_PORTS}  # free ones, not the fixed defaults
        assert len(ports) == len(HAPROXY_SIDE_PORTS) and not ports & {8404, 9101, 8500, 9500}
    else:
        assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ


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
